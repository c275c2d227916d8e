"""Auto tool choice, `/invocations` and `return_token_ids` through the HTTP API.

In-process (ASGI) over a real AsyncLLM serving the tiny random Llama, whose generated text is
replaced by a scripted one (`ScriptedText`): tokenizing, templating, validation and the queue
are the real ones; the model "answers" with a Hermes tool call. The official `openai` client
must read the calls; `pagoda serve` must refuse a bad parser before loading anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import test_health as health

from pagoda.async_engine import AsyncLLM
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server import serve
from pagoda.server.api import build_app
from pagoda.server.serving import ServerContext
from pagoda.server.tool_parsers import get_tool_parser

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
ARGUMENTS = {"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}
CALL_TEXT = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": '
             + json.dumps(ARGUMENTS) + "}\n</tool_call>")
AUTO_ERROR = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class ScriptedText:
    """The real engine for everything but generation, which answers `pieces` (one delta each,
    token ids 100, 101, ...); records each request's sampling params."""

    def __init__(self, engine: AsyncLLM, pieces: list[str]) -> None:
        self.engine = engine
        self.pieces = pieces
        self.params: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_request(self, req: Any) -> AsyncIterator[RequestOutput]:
        self.params.append(req.sampling_params)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestOutput(req.request_id, None, req.prompt_token_ids, [CompletionOutput(
                0, piece, [100 + i], finish_reason="stop" if last else None)], last)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(tiny_llama, None, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def app(engine: Any, parser: str | None = "hermes") -> Any:
    ctx = ServerContext(engine=engine, served_model_names=["tiny"], model_path="tiny",
                        max_model_len=512,
                        tool_parser=get_tool_parser(parser) if parser else None)
    return build_app(ctx, web_ui=False)


def post(engine: Any, path: str, body: dict, parser: str | None = "hermes") -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app(engine, parser))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def chat(**extra: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], **extra}


def sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_auto_tool_call_in_the_openai_shape(engine: AsyncLLM):
    r = post(ScriptedText(engine, [CALL_TEXT]), "/v1/chat/completions", chat(tool_choice="auto"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will check. "
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS


def test_the_openai_client_reads_the_calls(engine: AsyncLLM):
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app(ScriptedText(engine, [CALL_TEXT])))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            # NOTE: no tool_choice: with tools, vLLM (and LangChain's bind_tools) mean "auto".
            return await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                tools=[WEATHER])  # type: ignore[list-item]

    response = asyncio.run(main())
    [call] = response.choices[0].message.tool_calls or []
    assert response.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == ARGUMENTS  # type: ignore[union-attr]


def test_streamed_arguments_arrive_in_pieces(engine: AsyncLLM):
    pieces = [CALL_TEXT[i:i + 4] for i in range(0, len(CALL_TEXT), 4)]
    events = sse(post(ScriptedText(engine, pieces), "/v1/chat/completions", chat(stream=True)))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call-")
    assert first["function"]["name"] == "get_weather"
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
               for tc in rest)
    assert len([tc for tc in calls if tc["function"].get("arguments")]) > 1
    arguments = "".join(tc["function"].get("arguments", "") for tc in calls)
    assert json.loads(arguments) == ARGUMENTS
    assert "".join(d.get("content", "") for d in deltas) == "I will check. "
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_plain_answer_stays_content(engine: AsyncLLM):
    r = post(ScriptedText(engine, ["It is ", "sunny."]), "/v1/chat/completions", chat())
    choice = r.json()["choices"][0]
    # NOTE: no tool_calls member without calls, as OpenAI's and vLLM's answers
    assert choice["message"] == {"role": "assistant", "content": "It is sunny.",
                                 "reasoning": None, "reasoning_content": None}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("extra", [{"tool_choice": "auto"}, {}])
def test_auto_without_the_flags_is_vllms_400(engine: AsyncLLM, extra: dict):
    r = post(ScriptedText(engine, [CALL_TEXT]), "/v1/chat/completions", chat(**extra),
             parser=None)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == AUTO_ERROR


def test_mistral_keeps_special_tokens(engine: AsyncLLM):
    scripted = ScriptedText(engine, ['[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'])
    r = post(scripted, "/v1/chat/completions", chat(), parser="mistral")
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(call["id"]) == 9 and call["function"]["arguments"] == "{}"
    assert scripted.params[0].skip_special_tokens is False


def test_invocations_routes_by_body(engine: AsyncLLM):
    scripted = ScriptedText(engine, ["Hello", "!"])
    as_chat = post(scripted, "/invocations", {"messages": [{"role": "user", "content": "hi"}]})
    assert as_chat.status_code == 200, as_chat.text
    assert as_chat.json()["object"] == "chat.completion"
    assert as_chat.json()["choices"][0]["message"]["content"] == "Hello!"
    as_completion = post(scripted, "/invocations", {"prompt": "hi", "max_tokens": 4})
    assert as_completion.json()["object"] == "text_completion"
    assert as_completion.json()["choices"][0]["text"] == "Hello!"
    neither = post(scripted, "/invocations", {"max_tokens": 4})
    assert neither.status_code == 400
    assert "Cannot find suitable handler" in neither.json()["error"]["message"]


def test_return_token_ids_only_when_asked(engine: AsyncLLM):
    scripted = ScriptedText(engine, ["Hello", "!"])
    prompt_ids = engine.tokenizer.encode("hi")
    completion = post(scripted, "/v1/completions", {"prompt": "hi", "return_token_ids": True})
    choice = completion.json()["choices"][0]
    assert choice["token_ids"] == [100, 101] and choice["prompt_token_ids"] == prompt_ids
    chat_r = post(scripted, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True})
    assert chat_r.json()["choices"][0]["token_ids"] == [100, 101]
    assert len(chat_r.json()["prompt_token_ids"]) == chat_r.json()["usage"]["prompt_tokens"]
    plain = post(scripted, "/v1/completions", {"prompt": "hi"}).json()
    # NOTE: unasked, null as in vLLM's whole responses (its clients read them as attributes)
    assert {k: plain["choices"][0][k] for k in ("token_ids", "prompt_token_ids", "prompt_logprobs")} == dict.fromkeys(
        ("token_ids", "prompt_token_ids", "prompt_logprobs"))
    plain_chat = post(scripted, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert plain_chat["choices"][0]["token_ids"] is None and plain_chat["prompt_token_ids"] is None
    assert plain_chat["prompt_logprobs"] is None


def test_return_token_ids_streamed(engine: AsyncLLM):
    scripted = ScriptedText(engine, ["Hello", "!"])
    events = sse(post(scripted, "/v1/completions",
                      {"prompt": "hi", "stream": True, "return_token_ids": True}))
    assert [e["choices"][0]["token_ids"] for e in events] == [[100], [101]]
    assert "prompt_token_ids" in events[0]["choices"][0]
    assert "prompt_token_ids" not in events[1]["choices"][0]
    events = sse(post(scripted, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True}))
    assert events[0]["prompt_token_ids"] and "prompt_token_ids" not in events[1]
    assert [e["choices"][0]["token_ids"] for e in events[1:]] == [[100], [101]]
    # NOTE: a delta whose text is held back (a character's first bytes) still brings its ids,
    # in a chunk with an empty delta (vLLM's test_chat_completion_with_emoji_and_token_ids)
    held = ScriptedText(engine, ["Hello", "", "!"])
    events = sse(post(held, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True}))
    assert [e["choices"][0]["token_ids"] for e in events[1:]] == [[100], [101], [102]]
    assert events[2]["choices"][0]["delta"] == {"content": ""}


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    return parser.parse_args(["tiny", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "invalid tool call parser: 'nope' (choose from hermes, llama3_json, mistral, pythonic)"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_a_bad_parser_stops_serve_before_loading(flags: list[str], message: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(serve, "_load_engine", lambda *a: pytest.fail("loaded the model"))
    assert serve.run_serve(serve_args(*flags)) == 2
    assert message in capsys.readouterr().err


def test_the_parser_is_used_only_with_the_flag():
    assert serve.auto_tool_parser(serve_args("--tool-call-parser", "hermes")) is None
    parser = serve.auto_tool_parser(serve_args("--enable-auto-tool-choice",
                                               "--tool-call-parser", "pythonic"))
    assert parser is not None and parser.name == "pythonic"
