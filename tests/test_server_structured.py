"""Structured outputs, tool calls, logit_bias and refused fields through the HTTP API.

In-process (ASGI) over a real AsyncLLM serving the tiny random Llama: whatever the random
model prefers, constrained outputs must match; every field is honoured or refused by name.
The Hermes tool-call parser and stream assembly are checked on written outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import test_health as health

from pagoda.async_engine import AsyncLLM
from pagoda.server.protocol import ChatCompletionTool, FunctionDefinition
from pagoda.server.tool_parsers import HermesToolParser
from pagoda.server.tools import ToolPlan, ToolStream, parse_calls

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "JST"]}}}}}
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(tiny_llama, None, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def post(engine: AsyncLLM, path: str, body: dict, **ctx: object) -> httpx.Response:
    async def main() -> httpx.Response:
        async with health.app_client(engine, **ctx) as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def chat(content: str = "hi", **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 60,
            "temperature": 0, **extra}


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_response_format_json_schema(engine: AsyncLLM):
    schema = WEATHER["function"]["parameters"]
    r = post(engine, "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}))
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("body, check", [
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"guided_regex": r"[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"json": {"enum": [1, 2, 3]}}}, lambda t: json.loads(t) in (1, 2, 3)),
    ({"guided_json": {"type": "boolean"}}, lambda t: t in ("true", "false")),
])
def test_vllm_constraint_fields_on_completions(engine: AsyncLLM, body: dict, check):
    r = post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 20, **body})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert check(text), text


def test_logit_bias_through_the_api(engine: AsyncLLM):
    r = post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 5, "temperature": 0,
                                          "ignore_eos": True, "logit_bias": {"777": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode([777] * 5)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}), "response_format", "Invalid json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9"}, "guided_regex",
     "Invalid regex"),
    # NOTE: the fuzzer's finds: llguidance's GBNF converter fails with its own errors
    ("/v1/completions", {"prompt": "0", "guided_grammar": "0"}, "guided_grammar", "Invalid grammar"),
    ("/v1/completions", {"prompt": "0", "guided_grammar": "a ::= \"x\""}, "guided_grammar",
     "Invalid grammar"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]},
     "guided_choice", "Only one output constraint"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "Unsupported parameter"),
    ("/v1/chat/completions", chat(continue_final_message=True), "continue_final_message",
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ("/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions",
     "Unsupported parameter"),
    ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend", "llguidance"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    # NOTE: pydantic's bound and its error type in the words, as vLLM's (its test_long_seed)
    ("/v1/chat/completions", chat(seed=2**63), "seed", "less_than_equal"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed", "greater_than_equal"),
    # NOTE: every bad key at once, as vLLM (its test_chat_logit_bias_multiple_non_integer_keys)
    ("/v1/chat/completions", chat(logit_bias={"bad1": 50.0, "5": 1, "bad2": 20.0}), "logit_bias",
     "['bad1', 'bad2']"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias",
     "out of vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ("/v1/chat/completions", chat(tools=[WEATHER]), "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", "not among"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice", "needs tools"),
    ("/v1/chat/completions", chat(tools=[WEATHER, WEATHER], tool_choice="required"), "tools",
     "unique"),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required",
                                  response_format={"type": "json_object"}),
     "response_format", "cannot be combined"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages", "text"),
])
def test_refusals_name_the_field(engine: AsyncLLM, path: str, body: dict, param: str,
                                 words: str):
    err = error(post(engine, path, body))
    assert err["param"] == param and words in err["message"], err


def test_named_tool_call(engine: AsyncLLM):
    body = chat("Weather?", tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = post(engine, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # NOTE: a forced call's content is "", as vLLM's (its test_named_tool_use reads its length)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    streamed = post(engine, "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    calls = [tc for d in deltas for c in d["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments", "") for c in calls) == \
        call["function"]["arguments"]
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"


def test_required_tool_call_with_refs_to_defs(engine: AsyncLLM):
    """A tool's parameters with `$defs` and `$ref`s into them (pydantic writes them so): under
    "required" its defs are lifted to the calls' schema root, as vLLM's _get_tool_schema_defs
    lifts them (they were "Pointer '/$defs/Unit' does not exist" here); one name with two
    schemas is a 400 naming it."""
    unit = {"enum": ["C", "F"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}}
    body = chat("Weather?", tools=[tool, TIME], tool_choice="required", parallel_tool_calls=False,
                max_tokens=60)
    r = post(engine, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    if call["name"] == "get_weather":
        assert json.loads(call["arguments"])["unit"] in ("C", "F")
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"enum": ["K"]}}}}}
    err = error(post(engine, "/v1/chat/completions", {**body, "tools": [tool, other]}))
    assert err["param"] == "tools" and "'Unit' has multiple schemas" in err["message"]


def test_required_tool_call(engine: AsyncLLM):
    # NOTE: one call (parallel_tool_calls false): a random model would extend an open array
    # forever; the parallel form runs on the real SmolLM2 (test_server_smollm2.py).
    body = chat("Weather and time?", tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False, max_tokens=120)
    r = post(engine, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])
    streamed = post(engine, "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    got: dict[int, dict] = {}
    for tc in (tc for d in deltas for c in d["choices"] for tc in c["delta"].get("tool_calls", [])):
        function = got.setdefault(tc["index"], {"name": tc["function"].get("name"),
                                                "arguments": ""})
        function["arguments"] += tc["function"].get("arguments", "")
    # NOTE: the arguments stream in fragments as they are generated, adding up to the same.
    assert sum(1 for d in deltas for c in d["choices"] if c["delta"].get("tool_calls")) > 1
    assert [(f["name"], f["arguments"]) for f in got.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_auto_uses_the_templates_tool_format(engine: AsyncLLM):
    r = post(engine, "/v1/chat/completions", chat("Weather?", tools=[WEATHER], max_tokens=8),
             chat_template=HERMES_TEMPLATE, tool_parser=HermesToolParser())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 40  # the tools were rendered into the prompt


def plan(mode: str, named: str | None = None) -> ToolPlan:
    tools = [ChatCompletionTool(function=FunctionDefinition(**WEATHER["function"]))]
    return ToolPlan(mode=mode, tools=tools, named=named, parser=HermesToolParser())


def test_hermes_parser_and_stream():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "C"}}\n</tool_call>')
    content, calls = parse_calls(plan("auto"), text)
    assert content == "Let me check. "  # NOTE: vLLM's: the text before the tag, as written
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    assert parse_calls(plan("auto"), "no calls here") == ("no calls here", [])
    assert parse_calls(plan("auto"), "<tool_call>{broken") == ("<tool_call>{broken", [])
    stream = ToolStream(plan("auto"))
    pieces = [p for chunk in ("Let me ", "check. <tool", "_call>\n{\"name\": \"get_weather\", ",
                              "\"arguments\": {}}\n</tool_call>") for p in stream.feed(chunk)]
    assert "".join(p.content or "" for p in pieces) == "Let me check. "
    tail, called = stream.finish()
    calls = [tc for p in pieces + tail for tc in p.tool_calls or []]
    assert called and calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == "{}"


def _stream_deltas(engine: AsyncLLM, body: dict, **ctx: object) -> list[dict]:
    streamed = post(engine, "/v1/chat/completions", {**body, "stream": True}, **ctx)
    assert streamed.status_code == 200, streamed.text
    return [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]]


@pytest.mark.parametrize("parser, choices, expected", [
    ("deepseek_r1", ["<think>plan it</think>yes"], ("plan it", "yes")),
    ("deepseek_r1", ["plan it</think>yes"], ("plan it", "yes")),
    ("qwen3", ["<think>plan it</think>yes"], ("plan it", "yes")),
    ("qwen3", ["plain answer"], (None, "plain answer")),
])
def test_reasoning_parser_splits_whole_and_streamed_answers(engine: AsyncLLM, parser, choices, expected):
    """vLLM's --reasoning-parser: the thinking in `reasoning` (and `reasoning_content`), the
    rest in `content`; a stream's deltas add up to the same. The answer is scripted (an output
    constraint holds only after the thinking, so it cannot force one)."""
    from test_server_tools import ScriptedText

    from pagoda.server.reasoning import get_reasoning_parser

    scripted = ScriptedText(engine, choices)
    ctx = {"reasoning_parser": get_reasoning_parser(parser)}
    body = chat()
    r = post(scripted, "/v1/chat/completions", body, **ctx)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == expected
    assert message["reasoning_content"] == message["reasoning"]
    deltas = _stream_deltas(scripted, body, **ctx)  # type: ignore[arg-type]
    assert "".join(d.get("reasoning") or "" for d in deltas) == (expected[0] or "")
    assert "".join(d.get("content") or "" for d in deltas) == (expected[1] or "")
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    hidden = post(scripted, "/v1/chat/completions", {**body, "include_reasoning": False}, **ctx)  # type: ignore[arg-type]
    assert hidden.json()["choices"][0]["message"]["reasoning"] is None
    assert not any(d.get("reasoning") for d in _stream_deltas(scripted, {**body, "include_reasoning": False}, **ctx))  # type: ignore[arg-type]
    plain = post(scripted, "/v1/chat/completions", body)  # type: ignore[arg-type]  # NOTE: without a parser, as is
    assert plain.json()["choices"][0]["message"]["content"] == "".join(choices)


def test_a_constraint_holds_once_the_thinking_ends(engine: AsyncLLM):
    """As vLLM with a reasoning parser: an output constraint (tools, response_format) holds
    only after the model's end of thinking (`reasoning_end`, here one token pushed up by a
    bias); before it every token is free. Without it the constraint holds from the first
    token. The server passes `</think>`'s tokens where the parser says the answer starts
    thinking (qwen3 unless enable_thinking is false; deepseek_r1 always)."""
    from pagoda.sampling_params import SamplingParams
    from pagoda.server.chat import reasoning_end
    from pagoda.server.protocol import ChatCompletionRequest
    from pagoda.server.reasoning import get_reasoning_parser
    from pagoda.server.serving import ServerContext
    from pagoda.structured_output import StructuredOutputsParams

    tokenizer = engine.tokenizer
    end = tokenizer.encode(" Paris", add_special_tokens=False)[-1]
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={end: 100.0},
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))

    async def run(request_id: str, ends: tuple[int, ...]) -> list[int]:
        req = engine.processor.process(request_id, [1, 504, 3575], params, reasoning_end=ends)
        return [t async for out in engine.generate_request(req) for t in out.outputs[0].token_ids]

    thinking_first = asyncio.run(run("think", (end,)))
    assert thinking_first[0] == end and tokenizer.decode(thinking_first[1:]) in ("alpha", "beta")
    constrained = asyncio.run(run("plain", ()))
    assert end not in constrained and tokenizer.decode(constrained) in ("alpha", "beta")
    ctx = ServerContext(engine=engine, served_model_names=["tiny"], model_path="tiny", max_model_len=64,
                        reasoning_parser=get_reasoning_parser("qwen3"))
    marks = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    off = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                chat_template_kwargs={"enable_thinking": False})
    assert reasoning_end(ctx, req) == marks and reasoning_end(ctx, off) == ()
    ctx.reasoning_parser = get_reasoning_parser("deepseek_r1")
    assert reasoning_end(ctx, off) == marks
    ctx.reasoning_parser = None
    assert reasoning_end(ctx, req) == ()


def _rendered(engine: AsyncLLM, body: dict, **ctx: object) -> str:
    r = post(engine, "/v1/chat/completions", {**body, "max_tokens": 1, "return_token_ids": True}, **ctx)
    assert r.status_code == 200, r.text
    return engine.tokenizer.decode(r.json()["prompt_token_ids"])


def test_a_request_chat_template_needs_the_trust_flag(engine: AsyncLLM):
    body = chat("hi", chat_template="X{{ messages[0]['content'] }}Y")
    err = error(post(engine, "/v1/chat/completions", body))
    assert err["message"].startswith("Chat template is passed with request, but --trust-request-chat-template")
    assert err["param"] == "chat_template"
    kwargs_body = chat("hi", chat_template_kwargs={"chat_template": "Z"})
    assert error(post(engine, "/v1/chat/completions", kwargs_body))["param"] == "chat_template"
    assert _rendered(engine, body, trust_request_chat_template=True) == "XhiY"
    assert _rendered(engine, kwargs_body, trust_request_chat_template=True) == "Z"


@pytest.mark.parametrize("setting, template, expected", [
    ("auto", "{% for p in messages[0]['content'] %}[{{ p['text'] }}]{% endfor %}", "[a][b]"),
    ("auto", "<{{ messages[0]['content'] }}>", "<a\nb>"),
    ("string", "<{{ messages[0]['content'] }}>", "<a\nb>"),
    ("openai", "{% for p in messages[0].content %}({{ p.text }}){% endfor %}", "(a)(b)"),
])
def test_chat_template_content_format(engine: AsyncLLM, setting, template, expected):
    from pagoda.server.chat import content_format

    body = chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])  # type: ignore[arg-type]
    assert _rendered(engine, body, chat_template=template, chat_template_content_format=setting) == expected
    assert content_format("auto", template) == ("openai" if "for p" in template else "string")


def test_default_chat_template_kwargs_sit_under_the_requests_own(engine: AsyncLLM):
    """vLLM's --default-chat-template-kwargs (e.g. a Qwen3 server started without thinking):
    every chat's template gets them; a request's chat_template_kwargs win key by key."""
    template = "{{ messages[0]['content'] }}|{{ 'think' if enable_thinking else 'plain' }}|{{ tone or '-' }}"
    ctx = {"chat_template": template, "default_chat_template_kwargs": {"enable_thinking": False, "tone": "dry"}}
    assert _rendered(engine, chat("hi"), **ctx) == "hi|plain|dry"
    assert _rendered(engine, chat("hi", chat_template_kwargs={"enable_thinking": True}), **ctx) == "hi|think|dry"
    assert _rendered(engine, chat("hi"), chat_template=template) == "hi|plain|-"


def test_reasoning_effort_and_documents_reach_the_template_as_vllm_sends_them(engine: AsyncLLM):
    """vLLM's chat fields `reasoning_effort` and `documents` are template variables; an effort
    also sets `enable_thinking` (false for "none") unless chat_template_kwargs sets it."""
    template = ("{{ reasoning_effort or '-' }}|{{ 'think' if enable_thinking else 'plain' }}|"
                "{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}")
    ctx = {"chat_template": template}
    assert _rendered(engine, chat("hi"), **ctx) == "-|plain|"
    assert _rendered(engine, chat("hi", reasoning_effort="high"), **ctx) == "high|think|"
    assert _rendered(engine, chat("hi", reasoning_effort="none"), **ctx) == "none|plain|"
    kept = chat("hi", reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert _rendered(engine, kept, **ctx) == "low|plain|"
    docs = chat("hi", documents=[{"title": "A", "text": "x"}, {"title": "B", "text": "y"}])
    assert _rendered(engine, docs, **ctx) == "-|plain|[A][B]"
    assert error(post(engine, "/v1/chat/completions", chat("hi", reasoning_effort="huge")))["param"] == "reasoning_effort"


def test_bad_words_reach_the_sampler_and_bad_ones_are_400s(engine: AsyncLLM):
    body = {"prompt": "words", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    free = post(engine, "/v1/completions", body).json()["choices"][0]["token_ids"]
    word = engine.tokenizer.decode(free[:1]).strip()
    banned = post(engine, "/v1/completions", {**body, "bad_words": [word]})
    assert banned.status_code == 200, banned.text
    got = banned.json()["choices"][0]["token_ids"]
    ids = engine.tokenizer.encode(word, add_special_tokens=False)
    assert all(got[i:i + len(ids)] != ids for i in range(len(got)))
    assert error(post(engine, "/v1/completions", {**body, "bad_words": ["a", ""]}))["param"] == "bad_words"
    assert error(post(engine, "/v1/chat/completions", chat("hi", bad_words=["x" * 2000])))["param"] == "bad_words"


def test_repetition_detection_over_http(engine: AsyncLLM):
    body = {"prompt": "loop", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": {"777": 100},
            "repetition_detection": {"max_pattern_size": 1, "min_count": 4}}
    choice = post(engine, "/v1/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "repetition" and choice["stop_reason"] == "repetition_detected"
    bad = {**body, "repetition_detection": {"max_pattern_size": 1, "min_count": 1}}
    assert error(post(engine, "/v1/completions", bad))["param"] == "repetition_detection"
    typo = {**body, "repetition_detection": {"max_pattern": 1}}
    assert post(engine, "/v1/completions", typo).status_code == 400
    huge = {**body, "repetition_detection": {"max_pattern_size": 10**9, "min_count": 2}}
    assert "at most 256" in error(post(engine, "/v1/completions", huge))["message"]
    many = {**body, "bad_words": [f"w{i}" for i in range(10_000)]}
    assert "Too many bad words: 10000" in error(post(engine, "/v1/completions", many))["message"]


def test_default_chat_template_kwargs_flag_takes_a_json_object():
    from pagoda.server.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "m", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--default-chat-template-kwargs", "[1]"])


@pytest.mark.parametrize("tracking", [True, False])
def test_server_load_counts_the_model_calls_in_flight(engine: AsyncLLM, tracking: bool):
    """vLLM's GET /load: with --enable-server-load-tracking, the calls running the model now
    (1 while a completion runs, 0 after; /load itself not counted); without it, always 0."""
    async def main() -> tuple[list[int], int]:
        async with health.app_client(engine, enable_server_load_tracking=tracking) as client:
            body = chat("hi", max_tokens=48, ignore_eos=True)
            running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            seen = []
            while not running.done():
                seen.append((await client.get("/load")).json()["server_load"])
                await asyncio.sleep(0.002)
            assert (await running).status_code == 200
            return seen, (await client.get("/load")).json()["server_load"]

    seen, after = asyncio.run(main())
    assert after == 0 and set(seen) <= {0, 1}
    assert (1 in seen) == tracking


def test_tool_choice_none_can_leave_the_tools_out_of_the_template(engine: AsyncLLM):
    """vLLM's --exclude-tools-when-tool-choice-none: with tool_choice "none" the template sees
    no tools; without the flag (the default) it still renders them."""
    body = chat("hi", tools=[WEATHER], tool_choice="none")
    assert "get_weather" in _rendered(engine, body, chat_template=HERMES_TEMPLATE)
    left_out = _rendered(engine, body, chat_template=HERMES_TEMPLATE, exclude_tools_when_tool_choice_none=True)
    assert "get_weather" not in left_out and "hi" in left_out
    auto = chat("hi", tools=[WEATHER], tool_choice="required")
    assert "get_weather" in _rendered(engine, auto, chat_template=HERMES_TEMPLATE,
                                      exclude_tools_when_tool_choice_none=True)


def test_response_role_names_the_answer_after_a_generation_prompt(engine: AsyncLLM):
    """vLLM's --response-role: the answer's role (whole and streamed) after a generation
    prompt; without one the answer continues the last message and takes its role."""
    body = chat("hi", max_tokens=3)
    whole = post(engine, "/v1/chat/completions", body, response_role="narrator").json()
    assert whole["choices"][0]["message"]["role"] == "narrator"
    assert _stream_deltas(engine, body, response_role="narrator")[0] == {"role": "narrator", "content": ""}
    assert post(engine, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == "assistant"
    cont = chat("hi", max_tokens=3, add_generation_prompt=False)
    assert post(engine, "/v1/chat/completions", cont, response_role="narrator").json()[
        "choices"][0]["message"]["role"] == "user"
    assert _stream_deltas(engine, cont)[0]["role"] == "user"
    from pagoda.server.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "m", "--response-role", "bot"]).response_role == "bot"
    assert parser.parse_args(["serve", "m"]).response_role == "assistant"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat("hi")),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_forced_usage_ends_every_stream_with_a_usage_chunk(engine: AsyncLLM, path: str, body: dict):
    """vLLM's --enable-force-include-usage: a stream's last chunk before [DONE] is its usage,
    asked for or not, and every chunk before carries the usage so far (vLLM's
    should_include_usage: continuous usage too)."""
    def events(**ctx: object) -> list[dict]:
        r = post(engine, path, {**body, "max_tokens": 3, "stream": True}, **ctx)
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    plain = events()
    assert [e for e in plain if not e["choices"]] == [] and all(e.get("usage") is None for e in plain)
    forced = events(force_include_usage=True)
    assert [e["usage"]["completion_tokens"] for e in forced if not e["choices"]] == [3]
    assert all(e.get("usage") is not None for e in forced)


def test_continue_final_message_and_echo(engine: AsyncLLM):
    """vLLM's chat `continue_final_message` (the last message left open: no end of turn after
    it) and `echo` (the answer starts with that message's text where it has the answer's role),
    streamed or not; echo leaves another role's last message out (vLLM's test_chat_echo)."""
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "a saying?"}, {"role": "assistant", "content": saying}]
    open_end = post(engine, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    closed = post(engine, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    tokenizer = engine.tokenizer
    assert tokenizer.decode(open_end).endswith(saying) and not tokenizer.decode(closed).endswith(saying)
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True, "max_tokens": 4, "temperature": 0}
    r = post(engine, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith(saying)
    assert r.json()["usage"]["prompt_tokens"] == len(open_end)
    streamed = post(engine, "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert deltas[1] == {"content": saying}
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    plain = post(engine, "/v1/chat/completions", {**body, "echo": False}).json()["choices"][0]["message"]
    assert message["content"] == saying + plain["content"]
    other_role = post(engine, "/v1/chat/completions", {**chat("hi"), "echo": True, "max_tokens": 4}).json()
    assert not other_role["choices"][0]["message"]["content"].startswith("hi")


def test_batch_chat_completions(engine: AsyncLLM):
    """vLLM's POST /v1/chat/completions/batch: choice i answers conversation i exactly as the
    same conversation alone (greedy), the usage summed; streaming, tools, beam search and n > 1
    are vLLM's 400s."""
    conversations = [[{"role": "user", "content": "alpha"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "beta"}]]
    body = {"messages": conversations, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    r = post(engine, "/v1/chat/completions/batch", body)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    alone = [post(engine, "/v1/chat/completions", {**body, "messages": conv}).json() for conv in conversations]
    for choice, single in zip(batch["choices"], alone, strict=True):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["logprobs"]["content"][0]["token"] == single["choices"][0]["logprobs"]["content"][0]["token"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in alone)
    for extra, param in (({"stream": True}, "stream"), ({"tools": [WEATHER]}, "tools"),
                         ({"use_beam_search": True}, "use_beam_search"), ({"n": 2}, "n")):
        assert error(post(engine, "/v1/chat/completions/batch", {**body, **extra}))["param"] == param
    assert post(engine, "/v1/chat/completions/batch", {**body, "messages": []}).status_code == 400


def test_kv_transfer_params_prompt_token_ids_are_the_prompt(engine: AsyncLLM):
    """vLLM's disaggregated serving hands the decode stage the prefill stage's prompt ids in
    `kv_transfer_params`: the answer continues those ids, not the request's own messages
    (vLLM's test_kv_transfer_prompt_token_ids_round_trip); greedy, the same answer."""
    first = post(engine, "/v1/chat/completions", {**chat("Hello, how are you?"), "max_tokens": 8,
                                                   "return_token_ids": True}).json()
    ids = first["prompt_token_ids"]
    body = {**chat("unrelated"), "max_tokens": 8, "return_token_ids": True, "kv_transfer_params": {"prompt_token_ids": ids}}
    again = post(engine, "/v1/chat/completions", body).json()
    assert again["prompt_token_ids"] == ids
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    streamed = post(engine, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == ids
    for bad in ([], ["a"], [10**7]):
        r = post(engine, "/v1/chat/completions", {**body, "kv_transfer_params": {"prompt_token_ids": bad}})
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_no_call(engine: AsyncLLM, tool_choice: object):
    """vLLM's test_max_tokens_with_tool_choice_required: one token of a forced call is a
    "length" answer with empty content and no tool_calls (OpenAI's), not a call of '{"'."""
    r = post(engine, "/v1/chat/completions", chat("Weather?", tools=[WEATHER, TIME], tool_choice=tool_choice,
                                                  max_tokens=1))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert "tool_calls" not in choice["message"]


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_stream_interval_batches_a_streams_tokens_as_vllm(engine: AsyncLLM):
    """vLLM's `stream_interval`: the first token at once, then chunks of at least N tokens,
    the last whatever is left; the text is the same, and a whole answer is unchanged."""
    body = {"prompt": "chunks", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(engine, "/v1/completions", body).json()["choices"][0]
    for interval, sizes in ((None, [1] * 10), (4, [1, 4, 4, 1]), (20, [1, 9])):
        extra = {} if interval is None else {"stream_interval": interval}
        chunks = [e["choices"][0] for e in _events(post(engine, "/v1/completions",
                                                        {**body, "stream": True, **extra}))]
        assert [len(c["token_ids"]) for c in chunks] == sizes
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]
    assert post(engine, "/v1/completions", {**body, "stream_interval": 3}).json()["choices"][0] == whole
    assert error(post(engine, "/v1/completions", {**body, "stream_interval": 0}))["param"] == "stream_interval"
    streamed = _events(post(engine, "/v1/chat/completions", chat("hi", max_tokens=9, ignore_eos=True, stream=True,
                                                                 stream_interval=4, return_token_ids=True)))
    # NOTE: the role chunk, then the tokens as above
    assert [len(e["choices"][0].get("token_ids", [])) for e in streamed] == [0, 1, 4, 4]


def test_return_prompt_text_gives_the_rendered_chat_prompt(engine: AsyncLLM):
    body = chat("hello there", max_tokens=3, return_token_ids=True)
    plain = post(engine, "/v1/chat/completions", body).json()
    assert plain["prompt_text"] is None
    asked = post(engine, "/v1/chat/completions", {**body, "return_prompt_text": True}).json()
    assert asked["prompt_text"] == engine.tokenizer.decode(asked["prompt_token_ids"])
    assert "hello there" in asked["prompt_text"]
    chunks = _events(post(engine, "/v1/chat/completions", {**body, "return_prompt_text": True, "stream": True}))
    assert chunks[0]["prompt_text"] == asked["prompt_text"]
    assert all("prompt_text" not in c for c in chunks[1:])
    assert all("prompt_text" not in c for c in _events(post(engine, "/v1/chat/completions",
                                                            {**body, "stream": True})))


def test_a_thinking_budget_needs_the_servers_reasoning_config(engine: AsyncLLM):
    err = error(post(engine, "/v1/chat/completions", chat("hi", thinking_token_budget=8)))
    assert err["param"] == "thinking_token_budget" and "--reasoning-parser" in err["message"]
    assert post(engine, "/v1/chat/completions", chat("hi", max_tokens=2, thinking_token_budget=-1)).status_code == 200


def test_the_request_log_names_params_and_answers_as_vllms(engine: AsyncLLM, caplog: pytest.LogCaptureFixture):
    """--enable-log-requests / --enable-log-outputs / --max-log-len: vLLM's lines, in-process."""
    from test_server_api import serve_parser

    from pagoda.server.request_logger import RequestLogger
    from pagoda.server.serve import request_logger

    def flags(*given: str) -> RequestLogger | None:
        return request_logger(serve_parser().parse_args(["serve", "m", *given]))

    assert flags() is None
    assert flags("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "7") == RequestLogger(7, True, True)
    with pytest.raises(ValueError, match="requires --enable-log-requests"):
        flags("--enable-log-outputs")
    log = RequestLogger(max_log_len=12, log_outputs=True)
    body = {"prompt": "log me", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with caplog.at_level("DEBUG", logger="pagoda.server.request_logger"):
        whole = post(engine, "/v1/completions", body, request_logger=log).json()
        _events(post(engine, "/v1/completions", {**body, "stream": True}, request_logger=log))
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.server.request_logger"]
    received = [line for line in lines if line.startswith("Received request ")]
    assert len(received) == 2 and all("max_tokens=5" in line for line in received)
    assert any(line.startswith("Request ") and "prompt: 'log me'" in line for line in lines)
    answer = repr(whole["choices"][0]["text"][:12])
    assert any(line.endswith(f": output: {answer}, finish_reason: length") and "(streaming" not in line
               for line in lines)
    assert any(f"(streaming complete): output: {answer}, finish_reason: length" in line for line in lines)
    assert sum("(streaming delta)" in line and "output_token_ids" not in line for line in lines) == 5
    caplog.clear()
    with caplog.at_level("DEBUG", logger="pagoda.server.request_logger"):
        post(engine, "/v1/completions", body)  # NOTE: no logger: nothing logged
    assert not [r for r in caplog.records if r.name == "pagoda.server.request_logger"]
