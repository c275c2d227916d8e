"""Tool calls on chat: `tools` + `tool_choice` in, OpenAI `tool_calls` out.

- a named function: the output is generated under that function's parameter schema and
  returned as one call (OpenAI's finish_reason "stop");
- "required": the output is a JSON array of calls (`{"name", "parameters"}`, one schema per
  function; at most one call without `parallel_tool_calls`), returned as calls;
- "auto" (also what tools without a `tool_choice` mean, as in vLLM): free generation, the
  server's tool-call parser (`--enable-auto-tool-choice --tool-call-parser NAME`,
  `tool_parsers.py`) taking the calls out of the text; without one it is vLLM's 400;
- "none" (or no tools): plain chat.
`ToolStream` turns a choice's streamed text into content and tool-call deltas: a call's first
delta carries its index, id, type and name, later ones fragments of its arguments, as they
are generated (for "required" too: its array is read by the same scanning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagoda.server.errors import bad_request
from pagoda.server.partial_json import skip_ws
from pagoda.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from pagoda.server.tool_parsers import (
    PartialCall,
    Scan,
    ToolParser,
    checked,
    json_call_array,
)
from pagoda.structured_output import StructuredOutputsParams

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     "--tool-call-parser to be set")


class RequiredCallsParser(ToolParser):
    """The JSON array "required" generates under: `[{"name": ..., "parameters": {...}}]`."""

    name = "required"
    call_format = '[{"name": "<function name>", "parameters": {<arguments>}}]'

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        try:
            calls, end = self._calls(text)
            if end is None:
                raise ValueError("unfinished array")
            return None, [checked(call) for call in calls]
        except ValueError:
            return text, []  # NOTE: cut by max_tokens before the array closed

    def scan(self, text: str) -> Scan:
        try:
            return Scan(0, self._calls(text)[0])
        except ValueError:
            return Scan(0)

    def _calls(self, text: str) -> tuple[list[PartialCall], int | None]:
        i = skip_ws(text, 0)
        if i == len(text):
            return [], None
        if text[i] != "[":
            raise ValueError("not an array")
        return json_call_array(text, i, ("parameters",))


@dataclass
class ToolPlan:
    """How one chat request treats its tools; `parser` reads the calls of auto and required."""

    mode: str = "none"  # none | auto | required | named
    tools: list[ChatCompletionTool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint named and required calls generate under."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_schema(self._tool(self.named)))
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def system_note(self) -> str:
        """The tools described for a template that has no tool format of its own."""
        functions = json.dumps([t.function.model_dump(exclude_none=True) for t in self.tools],
                               ensure_ascii=False)
        if self.mode == "auto" and self.parser is not None:
            return (f"You can call these functions: {functions}\nTo call one, answer with "
                    f"{self.parser.call_format}")
        return ("You can call these functions; answer with the call as JSON only.\n" + functions)

    def _tool(self, name: str | None) -> ChatCompletionTool:
        return next(t for t in self.tools if t.function.name == name)


def plan_tools(req: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    """Validates `tools`/`tool_choice` (400s) and decides the mode.

    Args:
        parser: the server's tool-call parser for "auto" (None without
            `--enable-auto-tool-choice`, where "auto" is vLLM's 400).
    """
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("Tool names must be unique.", "tools")
    plan = ToolPlan(tools=tools, parallel=req.parallel_tool_calls)
    if choice == "none":
        return plan
    if choice is None or choice == "auto":
        if parser is None:
            raise bad_request(AUTO_NEEDS_PARSER, "tool_choice")
        plan.mode, plan.parser = "auto", parser
    elif choice == "required":
        plan.mode, plan.parser = "required", RequiredCallsParser()
    else:
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among "
                              "the tools.", "tool_choice")
        plan.mode, plan.named = "named", choice.function.name
    return plan


def _schema(tool: ChatCompletionTool) -> dict[str, Any]:
    """The tool's parameters schema (an empty object where it has none)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    """The tool's parameters schema without its `$defs` (which `_shared_defs` lifts)."""
    return {k: v for k, v in _schema(tool).items() if k != "$defs"}


def _shared_defs(tools: list[ChatCompletionTool]) -> dict[str, Any]:
    """Every tool's `$defs`, lifted to the root of the calls' schema where their `$ref`s
    ("#/$defs/X") point, as vLLM lifts them; one name with two schemas is a 400."""
    shared: dict[str, Any] = {}
    for tool in tools:
        defs = (tool.function.parameters or {}).get("$defs", {})
        if not isinstance(defs, dict):
            raise bad_request(f"`$defs` in the parameters of tool {tool.function.name!r} must be an "
                              f"object, got {type(defs).__name__}.", "tools")
        for name, schema in defs.items():
            if shared.setdefault(name, schema) != schema:
                raise bad_request(f"Tool definition {name!r} has multiple schemas, which is not "
                                  "supported.", "tools")
    return shared


def required_schema(tools: list[ChatCompletionTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each `{"name": one of the tools, "parameters": its schema}`."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    defs = _shared_defs(tools)
    if defs:
        schema["$defs"] = defs
    return schema


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the calls a finished output holds."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [ToolCall(function=FunctionCall(name=plan.named, arguments=text))]
    if plan.parser is None:
        return text, []
    content, calls = plan.parser.extract(text)
    return content, [ToolCall(id=plan.parser.call_id(), function=call) for call in calls]


class ToolStream:
    """One choice's stream: text deltas in, content and tool-call deltas out.

    The parser's `scan` of the text so far says what is surely content and how far each
    call is written; what is new since the last delta goes out. At the finish, the parser's
    `extract` of the whole text settles the rest, so the streamed calls and content add up
    to the non-streamed message.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.emitted = 0
        self.sent: list[str] = []  # each call's arguments streamed so far
        self.call_id = random_id("call")

    def feed(self, delta: str) -> list[DeltaMessage]:
        self.text += delta
        if self.plan.mode == "named":
            return self._named(delta)
        if self.plan.parser is None:
            return [DeltaMessage(content=delta)] if delta else []
        scan = self.plan.parser.scan(self.text)
        return self._content(scan.content_end) + self._calls(scan.calls)

    def step(self, delta: str, finished: bool) -> tuple[list[DeltaMessage], bool]:
        """A delta's content and tool-call deltas (at the finish, what the end releases too),
        and whether the choice called tools (known at the finish only)."""
        messages, called = self.feed(delta), False
        if finished:
            tail, called = self.finish()
            messages += tail
        return messages, called

    def finish(self) -> tuple[list[DeltaMessage], bool]:
        """The deltas the end releases, and whether the choice called tools."""
        if self.plan.mode == "named" or self.plan.parser is None:
            return [], self.plan.mode == "named"
        content, calls = self.plan.parser.extract(self.text)
        if calls:
            out = self._calls([PartialCall(c.name, c.arguments) for c in calls])
        elif not self.sent:
            out = self._content(len(self.text))
        else:
            # NOTE: a call that turned out malformed after its start went out cannot be
            # taken back; the stream ends with what was sent, as vLLM's does.
            out = []
        return out, bool(self.sent)

    def _content(self, end: int) -> list[DeltaMessage]:
        if end <= self.emitted:
            return []
        piece, self.emitted = self.text[self.emitted:end], end
        return [DeltaMessage(content=piece)]

    def _calls(self, calls: list[PartialCall]) -> list[DeltaMessage]:
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # NOTE: calls start in order; a later one waits for this name
            if index == len(self.sent):
                self.sent.append(call.arguments)
                assert self.plan.parser is not None
                out.append(_call_delta(index, call.arguments, self.plan.parser.call_id(),
                                       call.name))
            elif call.arguments.startswith(self.sent[index]) \
                    and len(call.arguments) > len(self.sent[index]):
                fragment = call.arguments[len(self.sent[index]):]
                self.sent[index] = call.arguments
                out.append(_call_delta(index, fragment))
        return out

    def _named(self, delta: str) -> list[DeltaMessage]:
        if not self.sent:
            self.sent.append(delta)
            assert self.plan.named is not None
            return [_call_delta(0, delta, self.call_id, self.plan.named)]
        return [_call_delta(0, delta)] if delta else []


def _call_delta(index: int, arguments: str, call_id: str | None = None,
                name: str | None = None) -> DeltaMessage:
    """A tool-call delta: the first of a call names it (id, type, name), later ones not."""
    call = DeltaToolCall(index=index, function=DeltaFunctionCall(name=name, arguments=arguments))
    if call_id is not None:
        call.id, call.type = call_id, "function"
    return DeltaMessage(tool_calls=[call])
