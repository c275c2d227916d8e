"""Tool calls on chat: `tools` + `tool_choice` in, OpenAI `tool_calls` out.

- a named function: the output is generated under that function's parameter schema and
  returned as one call (OpenAI's finish_reason "stop");
- "required": the output is a JSON array of calls (`{"name", "parameters"}`, one schema per
  function; at most one call without `parallel_tool_calls`), returned as calls;
- "auto": free generation with the tools rendered by the chat template, parsed by the
  Hermes format (`<tool_call>{"name", "arguments"}</tool_call>`), the one Qwen2/Qwen3 and
  most tool-tuned templates use. A template with no tool format cannot do "auto": that is a
  400 saying so (named and required calls still work: the tools are then described in a
  system message);
- "none" (or no tools): plain chat.
`ToolStream` turns a choice's streamed text into content and tool-call deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagoda.server.errors import bad_request
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
from pagoda.structured_output import StructuredOutputsParams

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolPlan:
    """How one chat request treats its tools."""

    mode: str = "none"  # none | auto | required | named
    tools: list[ChatCompletionTool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint named and required calls generate under."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.named)))
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def system_note(self) -> str:
        """The tools described for a template that has no tool format of its own."""
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        return ("You can call these functions; answer with the call as JSON only.\n"
                + json.dumps(functions, ensure_ascii=False))

    def _tool(self, name: str | None) -> ChatCompletionTool:
        return next(t for t in self.tools if t.function.name == name)


def plan_tools(req: ChatCompletionRequest, template_has_tools: bool) -> ToolPlan:
    """Validates `tools`/`tool_choice` (400s) and decides the mode."""
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
        if not template_has_tools:
            raise bad_request(
                "tool_choice 'auto' needs a chat template with a tool-call format, and this "
                "model's has none; use tool_choice 'required' or a named function, or pass a "
                "template with tools (--chat-template).", "tool_choice")
        plan.mode = "auto"
    elif choice == "required":
        plan.mode = "required"
    else:
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among "
                              "the tools.", "tool_choice")
        plan.mode, plan.named = "named", choice.function.name
    return plan


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


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
    return schema


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the calls a finished output holds."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [ToolCall(function=FunctionCall(name=plan.named, arguments=text))]
    if plan.mode == "required":
        try:
            items = json.loads(text)
            return None, [ToolCall(function=FunctionCall(
                name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False)))
                for item in items]
        except (ValueError, KeyError, TypeError):
            return text, []  # NOTE: cut by max_tokens before the array closed
    if plan.mode == "auto" and HERMES_OPEN in text:
        return _parse_hermes(text)
    return text, []


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            item = json.loads(body)
            calls.append(ToolCall(function=FunctionCall(
                name=str(item["name"]),
                arguments=json.dumps(item.get("arguments", {}), ensure_ascii=False))))
        except (ValueError, KeyError, TypeError):
            return text, []  # NOTE: not a well-formed call: the model's text, as it wrote it
    content = text[:text.index(HERMES_OPEN)].strip()
    return content or None, calls


class ToolStream:
    """One choice's stream: text deltas in, content and tool-call deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.emitted = 0
        self.call_id = random_id("call")
        self.named_started = False

    def feed(self, delta: str) -> list[DeltaMessage]:
        self.text += delta
        if self.plan.mode == "named":
            return self._named(delta)
        if self.plan.mode == "auto":
            return self._content_before_tag()
        return []  # NOTE: "required" is one JSON array: its calls are known at the end

    def finish(self) -> tuple[list[DeltaMessage], bool]:
        """The deltas the end releases, and whether the choice called tools."""
        if self.plan.mode == "named":
            return [], True
        _, calls = parse_calls(self.plan, self.text)
        out = []
        if not calls and len(self.text) > self.emitted:
            out.append(DeltaMessage(content=self.text[self.emitted:]))
        out += [DeltaMessage(tool_calls=[DeltaToolCall(
            index=i, id=call.id, type="function",
            function=DeltaFunctionCall(name=call.function.name,
                                       arguments=call.function.arguments))])
            for i, call in enumerate(calls)]
        return out, bool(calls)

    def _named(self, delta: str) -> list[DeltaMessage]:
        function = DeltaFunctionCall(arguments=delta)
        call = DeltaToolCall(index=0, function=function)
        if not self.named_started:
            self.named_started = True
            call.id, call.type, function.name = self.call_id, "function", self.plan.named
        return [DeltaMessage(tool_calls=[call])] if delta or call.id else []

    def _content_before_tag(self) -> list[DeltaMessage]:
        # NOTE: hold back what may be the start of "<tool_call>", as stop strings do.
        start = self.text.find(HERMES_OPEN)
        end = start if start != -1 else _safe_end(self.text, HERMES_OPEN)
        if end <= self.emitted:
            return []
        piece, self.emitted = self.text[self.emitted:end], end
        return [DeltaMessage(content=piece)]


def _safe_end(text: str, tag: str) -> int:
    """The end of the text that cannot be the beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return len(text) - size
    return len(text)
