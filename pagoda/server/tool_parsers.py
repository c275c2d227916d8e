"""Tool-call parsers: a model family's tool-call text -> OpenAI function calls.

`--enable-auto-tool-choice --tool-call-parser NAME` picks one by vLLM's name (`TOOL_PARSERS`)
for `tool_choice="auto"`. A parser is stateless:
- `extract(text)` reads a finished output (vLLM's `extract_tool_calls`): the content and the
  calls, or, when the calls are not well formed, the whole text as content and no calls;
- `scan(text)` reads an output so far: how much of it is surely content, and each call begun
  (its name once whole, the part of its arguments already written), which `ToolStream` turns
  into deltas.
Invariant: a call's `arguments` in any `scan` is a prefix of its arguments in the `extract`
of any longer text, so streamed fragments concatenate to the non-streamed arguments. For the
JSON formats the arguments are the model's own JSON text (vLLM re-serializes them; the value
is the same); for pythonic they are `json.dumps` of the keyword arguments.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagoda.server.partial_json import scan_object, skip_ws, value_end
from pagoda.server.protocol import FunctionCall, random_id


@dataclass
class PartialCall:
    """A call as far as it is written: the name once whole, the arguments so far."""

    name: str | None = None
    arguments: str = ""


@dataclass
class Scan:
    """What a partial output surely holds: `text[:content_end]` is content; the calls begun."""

    content_end: int
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(ABC):
    """One tool-call format. Subclasses set `name` (vLLM's) and `call_format` (the note a
    template without a tool format gets, so the model knows how to call)."""

    name: ClassVar[str]
    call_format: ClassVar[str]
    # NOTE: a format whose marker is a special token needs it kept in the text (vLLM's
    # mistral parser turns skip_special_tokens off the same way).
    skip_special_tokens: ClassVar[bool] = True

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """The content and the calls of a finished output."""

    @abstractmethod
    def scan(self, text: str) -> Scan:
        """What an output so far surely holds."""

    def call_id(self) -> str:
        return random_id("call")


def json_call(text: str, i: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object opening at `text[i]` (`{"name": ..., "arguments": {...}}`) and its end."""
    obj = scan_object(text, i)
    name = obj.value_of(text, "name")
    call = PartialCall(name=name if isinstance(name, str) else None)
    for key in argument_keys:
        arguments = obj.text_of(text, key)
        if arguments is not None:
            call.arguments = arguments
            break
    else:
        call.arguments = "{}" if obj.end is not None else ""
    return call, obj.end


def json_call_array(text: str, i: int, argument_keys: tuple[str, ...]
                    ) -> tuple[list[PartialCall], int | None]:
    """The calls of the array opening at `text[i]` (`[{call}, {call}]`) and its end."""
    calls: list[PartialCall] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return calls, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        call, end = json_call(text, j, argument_keys)
        calls.append(call)
        if end is None:
            break
        j = skip_ws(text, end)
    return calls, None


def checked(call: PartialCall, source: str = "{}") -> FunctionCall:
    """A finished call; ValueError when its source or arguments are not JSON, or it has no name."""
    json.loads(source)
    json.loads(call.arguments)
    if call.name is None:
        raise ValueError("a call without a name")
    return FunctionCall(name=call.name, arguments=call.arguments)


def content_end(text: str, marker: str) -> int:
    """Where `marker` starts, or the end of the text that cannot be its beginning."""
    start = text.find(marker)
    if start != -1:
        return start
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag per call (Qwen2.5,
    Qwen3, Hermes); the content is the text before the first tag."""

    name = "hermes"
    call_format = '<tool_call>{"name": "<function name>", "arguments": {<arguments>}}</tool_call>'
    OPEN = "<tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        scan = self.scan(text)
        if scan.content_end == len(text):
            return text, []
        try:
            calls = [checked(call, body) for body, call in zip(
                self._bodies(text), scan.calls, strict=True)]
        except ValueError:  # NOTE: a malformed call: the model's text, as it wrote it
            return text, []
        return text[:scan.content_end] or None, calls

    def scan(self, text: str) -> Scan:
        scan = Scan(content_end(text, self.OPEN))
        i = text.find(self.OPEN)
        while i != -1:
            j = skip_ws(text, i + len(self.OPEN))
            try:
                call, end = json_call(text, j, ("arguments",)) if j < len(text) else (None, None)
            except ValueError:
                break
            if call is not None:
                scan.calls.append(call)
            if end is None:
                break
            i = text.find(self.OPEN, end)
        return scan

    def _bodies(self, text: str) -> list[str]:
        return [m.strip() for m in re.findall(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.DOTALL)]


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: an output that starts with `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`; several joined by `;`) is calls only, no content."""

    name = "llama3_json"
    call_format = '{"name": "<function name>", "parameters": {<arguments>}}'
    TAG = "<|python_tag|>"
    KEYS = ("arguments", "parameters")

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = self._start(text)
        if start is None or start >= len(text):
            return text, []
        try:
            spans = self._calls(text, start)
            if not spans or spans[-1][2] is None:
                raise ValueError("unfinished call")
            return None, [checked(call, text[s:e]) for call, s, e in spans if e is not None]
        except ValueError:
            return text, []

    def scan(self, text: str) -> Scan:
        start = self._start(text)
        if start is None:
            return Scan(len(text))
        try:
            return Scan(0, [call for call, _, _ in self._calls(text, start)])
        except ValueError:
            return Scan(0)

    def _start(self, text: str) -> int | None:
        """Where the calls' JSON starts (the text's end while undecided); None: it is content."""
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            return skip_ws(text, i + len(self.TAG))
        if i == len(text) or text[i] == "{":
            return i
        return len(text) if self.TAG.startswith(text[i:]) else None

    def _calls(self, text: str, i: int) -> list[tuple[PartialCall, int, int | None]]:
        spans: list[tuple[PartialCall, int, int | None]] = []
        while i < len(text):
            call, end = json_call(text, i, self.KEYS)
            spans.append((call, i, end))
            if end is None:
                break
            j = skip_ws(text, end)
            if j >= len(text) or text[j] != ";":
                break
            i = skip_ws(text, j + 1)
        return spans


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo) or
    `[TOOL_CALLS]name{...}` per call (v11+ tokenizers); the content is what comes before."""

    name = "mistral"
    call_format = '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments>}}]'
    skip_special_tokens = False
    TAG = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.TAG)
        if start == -1:
            return text, []
        try:
            calls, complete = self._calls(text, start)
            if not complete or not calls:
                raise ValueError("unfinished call")
            return text[:start] or None, [checked(call) for call in calls]
        except ValueError:
            return text, []

    def scan(self, text: str) -> Scan:
        try:
            calls = self._calls(text, text.find(self.TAG))[0] if self.TAG in text else []
        except ValueError:
            calls = []
        return Scan(content_end(text, self.TAG), calls)

    def call_id(self) -> str:
        # NOTE: Mistral's templates accept only 9 alphanumeric characters as a call id.
        return "".join(random.choices(self._ID_CHARS, k=9))

    def _calls(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        i = skip_ws(text, start + len(self.TAG))
        if i < len(text) and text[i] == "[":
            calls, end = json_call_array(text, i, ("arguments",))
            return calls, end is not None
        calls = []
        for piece in text[start:].split(self.TAG)[1:]:
            name, brace, rest = piece.partition("{")
            if not brace:
                return calls, False
            end = value_end(brace + rest, 0)
            arguments = (brace + rest)[:end]
            calls.append(PartialCall(name=name.strip(), arguments=arguments))
            if end is None:
                return calls, False
        return calls, True


_IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=\s*")


class PythonicToolParser(ToolParser):
    """`[get_weather(city="Paris"), get_time()]` (Llama 3.2, Llama 4, ToolACE): an output that
    is a Python list of calls with literal keyword arguments is calls only."""

    name = "pythonic"
    call_format = '[<function name>(<argument>=<value>, ...)]'

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        if not text.strip().startswith("["):
            return text, []
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            return None, [_python_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError):
            return text, []

    def scan(self, text: str) -> Scan:
        i = skip_ws(text, 0)
        if i == len(text) or text[i] != "[":
            return Scan(0 if i == len(text) else len(text))
        scan, j = Scan(0), skip_ws(text, i + 1)
        try:
            while (call := _IDENTIFIER.match(text, j)) and text.startswith("(", call.end()):
                arguments, end = _python_arguments(text, call.end() + 1)
                scan.calls.append(PartialCall(call.group(), arguments))
                if end is None:
                    break
                j = skip_ws(text, end)
                j = skip_ws(text, j + 1) if text.startswith(",", j) else len(text)
        except (SyntaxError, ValueError, TypeError):
            pass
        return scan


def _python_call(node: ast.expr) -> FunctionCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name | ast.Attribute):
        raise ValueError("not a call")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    return FunctionCall(name=ast.unparse(node.func),
                        arguments=json.dumps(arguments, ensure_ascii=False))


def _python_arguments(text: str, i: int) -> tuple[str, int | None]:
    """The JSON of a call's keyword arguments written so far (`{"a": 1, ` ... `}` once the call
    closes) and the index after its `)`, None while it is open."""
    parts: list[str] = []
    while True:
        i = skip_ws(text, i)
        if i < len(text) and text[i] == ")":
            return "{" + ", ".join(parts) + "}", i + 1
        keyword = _KEYWORD.match(text, i)
        end = _python_value_end(text, keyword.end()) if keyword else None
        if keyword is None or end is None:
            return "{" + ", ".join(parts), None
        value = ast.literal_eval(text[keyword.end():end].strip())
        parts.append(f"{json.dumps(keyword.group(1), ensure_ascii=False)}: "
                     f"{json.dumps(value, ensure_ascii=False)}")
        i = end + 1 if text[end] == "," else end


def _python_value_end(text: str, i: int) -> int | None:
    """The index of the `,` or `)` that ends the argument value starting at `i`."""
    closing, quote = [], ""
    while i < len(text):
        char = text[i]
        if quote:
            i += 2 if char == "\\" else 1
            quote = "" if char == quote else quote
            continue
        if char in "'\"":
            quote = char
        elif char in "([{":
            closing.append(")]}"["([{".index(char)])
        elif closing and char == closing[-1]:
            closing.pop()
        elif not closing and char in ",)":
            return i
        i += 1
    return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser,
                                       MistralToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`.

    Raises:
        ValueError: no parser has that name (the message lists the names).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"invalid tool call parser: {name!r} (choose from "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()
