"""The tool-call parsers (server/tool_parsers.py) and their streaming (server/tools.py).

Model outputs in each format, as vLLM's own parser tests write them: plain content, one call,
several calls, malformed calls left as content. Streamed, the text is fed piece by piece
(one character at a time, and in uneven pieces); the deltas must add up to what the parser
extracts from the whole text, a call's first delta must name it and later ones carry only
argument fragments.
"""

from __future__ import annotations

import json

import pytest

from pagoda.server.protocol import DeltaMessage
from pagoda.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagoda.server.tools import RequiredCallsParser, ToolPlan, ToolStream

WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
USER = {"name": "Doe", "age": 9, "address": {"city": "San Francisco", "zip": "9{4}"},
        "tags": ["a", "b"], "passed_test": True, "note": None}
ONE = [("get_current_weather", WEATHER)]
TWO = [("get_current_weather", WEATHER), ("register_user", USER)]


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


# parser, model output, expected content, expected calls (name, arguments as a value)
CASES = [
    ("hermes", "The weather is sunny.", "The weather is sunny.", []),
    ("hermes", hermes_call(*ONE[0]), None, ONE),
    ("hermes", "Let me check. " + hermes_call(*ONE[0]), "Let me check. ", ONE),
    ("hermes", hermes_call(*TWO[0]) + "\n" + hermes_call(*TWO[1]), None, TWO),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("llama3_json", "Dallas is sunny today.", "Dallas is sunny today.", []),
    ("llama3_json", json.dumps({"name": "get_current_weather", "parameters": WEATHER}), None, ONE),
    ("llama3_json", "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "arguments": a}) for n, a in TWO), None, TWO),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in ONE]),
     None, ONE),
    ("mistral", "Sure. [TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in TWO]),
     "Sure. ", TWO),
    ("mistral", "".join(f"[TOOL_CALLS]{n}{json.dumps(a)}" for n, a in TWO), None, TWO),
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("pythonic", '[get_current_weather(city="Dallas", state=\'TX\', unit="fahrenheit")]', None,
     ONE),
    ("pythonic", '[get_current_weather(city="Dallas", state="TX", unit="fahrenheit"), '
                 'register_user(name="Doe", age=9, address={"city": "San Francisco", '
                 '"zip": "9{4}"}, tags=["a", "b"], passed_test=True, note=None)]', None, TWO),
    ("pythonic", "[]", "[]", []),
]
# parser, a malformed output (all content when whole), the content and the call names that
# stream before the fault shows (a call's start cannot be taken back, as in vLLM)
MALFORMED = [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', "Hi ", ["f"]),
    ("hermes", '<tool_call>{"name": f}</tool_call>', None, []),
    ("hermes", "<tool_call>", None, []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', "", ["f"]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', "", ["f"]),
    ("mistral", "[TOOL_CALLS]get_weather", None, []),
    ("pythonic", "[get_current_weather(city=Dallas)]", "", ["get_current_weather"]),
    ("pythonic", "[1, 2, 3]", None, []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name: str, text: str, content: str | None, calls: list):
    got_content, got_calls = get_tool_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("name, text, streamed_content, streamed_names", MALFORMED)
def test_malformed_calls_are_content(name: str, text: str, streamed_content: str | None,
                                     streamed_names: list[str]):
    assert get_tool_parser(name).extract(text) == (text, [])
    deltas, called = stream(ToolPlan(mode="auto", parser=get_tool_parser(name)), list(text))
    content, calls, _ = assemble(deltas)
    assert content == (text if streamed_content is None else streamed_content)
    assert [c["name"] for c in calls] == streamed_names and called == bool(streamed_names)


def stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[DeltaMessage], bool]:
    stream = ToolStream(plan)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    tail, called = stream.finish()
    return deltas + tail, called


def assemble(deltas: list[DeltaMessage]) -> tuple[str, list[dict], dict[int, int]]:
    """The streamed content, the calls, and how many deltas carried each call's arguments."""
    content, calls, fragments = "", [], {}
    for delta in deltas:
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                assert call.id and call.type == "function" and call.function.name, call
                calls.append({"name": call.function.name, "arguments": ""})
            else:
                assert call.id is None and call.function.name is None, call
            calls[call.index]["arguments"] += call.function.arguments or ""
            fragments[call.index] = fragments.get(call.index, 0) + bool(call.function.arguments)
    return content, calls, fragments


def uneven(text: str) -> list[str]:
    sizes, pieces, i = [1, 3, 2, 7, 5], [], 0
    while i < len(text):
        pieces.append(text[i:i + sizes[len(pieces) % len(sizes)]])
        i += len(pieces[-1])
    return pieces


@pytest.mark.parametrize("split", [list, uneven], ids=["by-char", "uneven"])
@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_adds_up_to_extract(name: str, text: str, content: str | None, calls: list,
                                   split):
    parser = get_tool_parser(name)
    deltas, called = stream(ToolPlan(mode="auto", parser=parser), split(text))
    got_content, got_calls, fragments = assemble(deltas)
    _, extracted = parser.extract(text)
    assert got_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in got_calls] == [
        (c.name, c.arguments) for c in extracted]
    assert called == bool(calls)
    for index, (_, arguments) in enumerate(calls):
        if arguments and split is list:
            assert fragments[index] > 1, "arguments must stream piece by piece, not at the end"


def test_content_streams_before_the_call_and_holds_back_a_tag():
    deltas, _ = stream(ToolPlan(mode="auto", parser=get_tool_parser("hermes")),
                       ["Let me ", "check <tool", "_call>", '{"name": "f", "arguments": {}}'])
    assert [d.content for d in deltas if d.content] == ["Let me ", "check "]


def test_required_array_streams_its_calls():
    text = json.dumps([{"name": n, "parameters": a} for n, a in TWO])
    deltas, called = stream(ToolPlan(mode="required", parser=RequiredCallsParser()), list(text))
    content, calls, fragments = assemble(deltas)
    assert called and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == TWO
    assert fragments[0] > 1 and fragments[1] > 1
    assert RequiredCallsParser().extract(text[:-3]) == (text[:-3], [])


def test_mistral_ids_are_nine_alphanumerics():
    call_id = get_tool_parser("mistral").call_id()
    assert len(call_id) == 9 and call_id.isalnum()


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
