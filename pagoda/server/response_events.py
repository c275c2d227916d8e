"""A streamed response's output as OpenAI's Responses events.

`OutputEvents` turns the chat path's deltas (`DeltaMessage`: content, or a tool call's start
and argument fragments, from `tools.ToolStream`) into output items and their events:
a message item (`response.output_item.added`, `response.content_part.added`, then
`response.output_text.delta`s; closed by `.output_text.done`, `.content_part.done`,
`.output_item.done`) or a function call item (`.output_item.added`, then
`response.function_call_arguments.delta`s; closed by `.function_call_arguments.done`,
`.output_item.done`), or a reasoning item (`.output_item.added`, then
`response.reasoning_text.delta`s; closed by `.reasoning_text.done`, `.output_item.done`). An item closes when the next one starts, or at the end, where the last
one takes the response's status ("incomplete" when `max_output_tokens` cut it). Invariant:
the items equal those the same text gives unstreamed (`output_items`), ids aside.
The events are plain dicts; `streaming.sse_events` numbers and frames them.
"""

from __future__ import annotations

from typing import Any

from pagoda.server.protocol import DeltaMessage
from pagoda.server.reasoning import ReasoningParser, split
from pagoda.server.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Status,
)
from pagoda.server.tools import ToolPlan, parse_calls

Event = dict[str, Any]


def output_items(plan: ToolPlan, text: str, status: Status,
                 parser: ReasoningParser | None = None) -> list[OutputItem]:
    """A finished output's items: its reasoning (with a reasoning parser, if it thought), a
    message (if it has text, or nothing else), then each tool call; the last item takes
    `status`, the others are complete."""
    thought, answer = split(parser, text) if parser is not None else (None, text)
    content, calls = parse_calls(plan, answer or "") if plan.calls_tools else (answer, [])
    items: list[OutputItem] = []
    if thought:
        items.append(ReasoningItem(content=[ReasoningText(text=thought)]))
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "")]))
    items += [FunctionCallItem(call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments) for call in calls]
    items[-1].status = status
    return items


class OutputEvents:
    """One stream's output items, as they are generated, and their events."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._text = ""  # the open item's text, or its arguments
        self._open = False

    def feed(self, delta: DeltaMessage) -> list[Event]:
        events: list[Event] = []
        if delta.content:
            if not (self._open and isinstance(self.items[-1], OutputMessage)):
                events += self._close("completed") + self._open_message()
            events.append(self._part_event("response.output_text.delta", delta=delta.content))
            self._text += delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:
                events += self._close("completed") + self._open_call(call.id, call.function.name)
            if call.function.arguments:
                events.append(self._item_event("response.function_call_arguments.delta",
                                               delta=call.function.arguments))
                self._text += call.function.arguments
        return events

    def feed_reasoning(self, text: str) -> list[Event]:
        """Reasoning text (a reasoning parser's), into the open reasoning item or a new one."""
        if not text:
            return []
        events: list[Event] = []
        if not (self._open and isinstance(self.items[-1], ReasoningItem)):
            events += self._close("completed")
            self._start(ReasoningItem(status="in_progress"))
            events.append(self._added())
        self._text += text
        return events + [self._item_event("response.reasoning_text.delta", content_index=0, delta=text)]

    def close(self, status: Status) -> list[Event]:
        """The end of the output: the open item done with `status` (an empty message first
        if nothing was generated)."""
        events = [] if self.items else self._open_message()
        return events + self._close(status)

    def _open_message(self) -> list[Event]:
        self._start(OutputMessage(status="in_progress"))
        return [self._added(), self._part_event("response.content_part.added", part=_part(""))]

    def _open_call(self, call_id: str, name: str | None) -> list[Event]:
        self._start(FunctionCallItem(call_id=call_id, name=name or "", status="in_progress"))
        return [self._added()]

    def _start(self, item: OutputItem) -> None:
        self.items.append(item)
        self._text, self._open = "", True

    def _added(self) -> Event:
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": self.items[-1].model_dump()}

    def _close(self, status: Status) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        item, text = self.items[-1], self._text
        item.status = status
        if isinstance(item, FunctionCallItem):
            item.arguments = text
            events = [self._item_event("response.function_call_arguments.done", arguments=text,
                                       name=item.name)]
        elif isinstance(item, ReasoningItem):
            item.content = [ReasoningText(text=text)]
            events = [self._item_event("response.reasoning_text.done", content_index=0, text=text)]
        else:
            item.content = [OutputText(text=text)]
            events = [self._part_event("response.output_text.done", text=text),
                      self._part_event("response.content_part.done", part=_part(text))]
        return events + [{"type": "response.output_item.done",
                          "output_index": len(self.items) - 1, "item": item.model_dump()}]

    def _item_event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "item_id": self.items[-1].id, "output_index": len(self.items) - 1,
                **fields}

    def _part_event(self, kind: str, **fields: Any) -> Event:
        event = self._item_event(kind, content_index=0, **fields)
        if kind in ("response.output_text.delta", "response.output_text.done"):
            event["logprobs"] = []
        return event


def _part(text: str) -> dict[str, Any]:
    return OutputText(text=text).model_dump()
