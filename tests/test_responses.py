"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) and `/invocations`.

In-process (ASGI) over a real AsyncLLM serving the tiny random Llama, one app for the module
(its store carries a conversation from one request to the next). Each request's prompt is
recorded as the engine received it, so what the chat template rendered is asserted, not
guessed; under greedy sampling the stream must add up to the unstreamed answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import test_health as health

from pagoda.async_engine import AsyncLLM
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server import serve
from pagoda.server.api import build_app
from pagoda.server.response_store import (
    DEFAULT_RESPONSES_STORE_SIZE,
    ResponseStore,
    StoredResponse,
)
from pagoda.server.serving import ServerContext

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]


class Recorder:
    """The real engine, recording the text of each prompt it is sent; `fail_after` makes the
    next generation fail after that many deltas, as an engine error would."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.prompts: list[str] = []
        self.fail_after: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate_request(self, req: Any) -> AsyncIterator[RequestOutput]:
        self.prompts.append(self.engine.tokenizer.decode(req.prompt_token_ids))
        if self.fail_after is not None:
            count, self.fail_after = self.fail_after, None
            return self._failing(req, count)
        return self.engine.generate_request(req)

    async def _failing(self, req: Any, count: int) -> AsyncIterator[RequestOutput]:
        for i in range(count):
            yield RequestOutput(req.request_id, None, req.prompt_token_ids,
                                [CompletionOutput(0, f"t{i} ", [100 + i])], False)
        raise RuntimeError("the engine exploded")


class Client:
    """Calls to one app (one response store), each in its own event loop."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = Recorder(engine)
        self.ctx = ServerContext(engine=self.engine, served_model_names=["tiny"],
                                 model_path="tiny", max_model_len=512,
                                 response_store=ResponseStore(8))
        self.app = build_app(self.ctx, web_ui=False)

    def request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        async def main() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return await c.request(method, path, json=body)

        return asyncio.run(main())

    def create(self, **body: Any) -> dict:
        r = self.request("POST", "/v1/responses", {"model": "tiny", "temperature": 0,
                                                   "max_output_tokens": 8, **body})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(tiny_llama, None, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: AsyncLLM) -> Client:
    return Client(engine)


def events(r: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, checking the framing."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    assert all(name == d["type"] for name, d in out)
    return out


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_text_response_usage_and_echoed_settings(client: Client):
    r = client.create(input="Say hi", instructions="Be brief.", metadata={"k": "v"}, user="u1")
    assert r["id"].startswith("resp_") and r["object"] == "response"
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = r["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert message["role"] == "assistant" and message["status"] == "incomplete"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["annotations"] == []
    prompt = client.engine.prompts[-1]
    tokenizer = client.engine.tokenizer
    assert prompt == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        add_generation_prompt=True, tokenize=False)
    usage = r["usage"]
    assert usage["input_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert usage["output_tokens"] == 8 and usage["total_tokens"] == usage["input_tokens"] + 8
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert (r["instructions"], r["metadata"], r["user"], r["max_output_tokens"]) == (
        "Be brief.", {"k": "v"}, "u1", 8)
    assert (r["temperature"], r["top_p"], r["tool_choice"], r["tools"]) == (0.0, 1.0, "auto", [])
    assert r["text"] == {"format": {"type": "text"}} and r["parallel_tool_calls"] is True


def test_stream_event_order_adds_up_to_the_unstreamed_text(client: Client):
    body = {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me"}]}], "temperature": 0, "max_output_tokens": 12}
    full = client.request("POST", "/v1/responses", body).json()
    got = events(client.request("POST", "/v1/responses", {**body, "stream": True}))
    names = [name for name, _ in got]
    assert names[:5] == STREAM_ORDER and names[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert set(names[5:-4]) == {"response.output_text.delta"}
    created = got[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    item_id = got[2][1]["item"]["id"]
    deltas = [d for name, d in got if name == "response.output_text.delta"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0)
               for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == output_text(full) and got[-4][1]["text"] == text
    final = got[-1][1]["response"]
    assert final["id"] == created["id"] and output_text(final) == text
    assert final["output"][0]["id"] == item_id
    # NOTE: the same prompt again: its full blocks now come from the prefix cache.
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert [final["usage"][k] for k in ("input_tokens", "output_tokens")] == \
        [full["usage"][k] for k in ("input_tokens", "output_tokens")]


def test_previous_response_id_continues_the_conversation(client: Client):
    first = client.create(input="My name is Ada.", instructions="Old rules.")
    second = client.create(input="What is my name?", previous_response_id=first["id"],
                           instructions="New rules.")
    assert second["previous_response_id"] == first["id"]
    tokenizer = client.engine.tokenizer
    # NOTE: OpenAI's rule: the earlier instructions do not carry over, the turns do.
    assert client.engine.prompts[-1] == tokenizer.apply_chat_template([
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "What is my name?"}],
        add_generation_prompt=True, tokenize=False)
    stored = client.request("GET", f"/v1/responses/{second['id']}")
    assert stored.status_code == 200 and stored.json() == second


def test_unknown_ids_are_404_and_store_false_keeps_nothing(client: Client):
    r = client.request("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"message": "Response with id 'resp_nope' not found.",
                                 "type": "invalid_request_error", "param": "previous_response_id",
                                 "code": 404}
    unstored = client.create(input="x", store=False)
    r = client.request("GET", f"/v1/responses/{unstored['id']}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_the_store_keeps_the_most_recently_used_and_its_flag_sizes_it():
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
        store.get("a")
    assert store.get("b") is None and len(store) == 2
    off = ResponseStore(0)
    off.put("a", StoredResponse({}, []))
    assert off.get("a") is None
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    assert parser.parse_args(["m"]).responses_store_size == DEFAULT_RESPONSES_STORE_SIZE
    assert parser.parse_args(["m", "--responses-store-size", "0"]).responses_store_size == 0


def test_json_schema_format_gives_json_of_the_schema(client: Client):
    schema = WEATHER["parameters"]
    r = client.create(input="Weather?", max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert r["status"] == "completed"
    jsonschema.validate(json.loads(output_text(r)), schema)
    assert r["text"]["format"]["schema"] == schema


def test_required_tool_choice_gives_a_function_call_then_its_output_continues(client: Client):
    r = client.create(input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False, max_output_tokens=60)
    [call] = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    follow = client.create(previous_response_id=r["id"], input=[{
        "type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    assert follow["status"] in ("completed", "incomplete")
    assert client.engine.prompts[-1].endswith("<|im_start|>tool\nsunny<|im_end|>\n"
                                              "<|im_start|>assistant\n")


def test_a_function_call_streams_its_arguments(client: Client):
    body = {"model": "tiny", "input": "Weather?", "tools": [WEATHER], "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
            "stream": True}
    got = events(client.request("POST", "/v1/responses", body))
    names = [name for name, _ in got]
    assert names[2] == "response.output_item.added" and got[2][1]["item"]["type"] == "function_call"
    fragments = [d["delta"] for name, d in got if name == "response.function_call_arguments.delta"]
    done = next(d for name, d in got if name == "response.function_call_arguments.done")
    assert len(fragments) > 1 and "".join(fragments) == done["arguments"]
    [item] = got[-1][1]["response"]["output"]
    assert item["arguments"] == done["arguments"] and item["name"] == "get_weather"


def test_an_engine_error_ends_the_stream_with_an_error_event(client: Client):
    client.engine.fail_after = 2
    got = events(client.request("POST", "/v1/responses", {"input": "x", "stream": True}))
    assert [d["delta"] for name, d in got if name == "response.output_text.delta"] == ["t0 ", "t1 "]
    name, error = got[-1]
    assert name == "error" and error["error"]["code"] == 500
    assert "the engine exploded" in error["message"]
    assert not any(name == "response.completed" for name, _ in got)


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "pagoda takes no other"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "'input_text' or 'output_text'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text",
     "'text', 'json_object' or 'json_schema'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "needs its `schema`"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'function'"),
    ({"input": "x", "tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "not among"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens", "maximum context length"),
    ({"input": []}, "input", "no item"),
    ({"input": "x", "background": True, "stream": True}, "background", "not supported with stream"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "Unsupported parameter"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
])
def test_bad_requests_are_clear_400s(client: Client, body: dict, param: str, words: str):
    r = client.request("POST", "/v1/responses", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_invocations_dispatch_by_body_shape(client: Client):
    chat = client.request("POST", "/invocations", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = client.request("POST", "/invocations", {"prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    response = client.request("POST", "/invocations", {"input": "hi", "max_output_tokens": 2})
    assert response.status_code == 200 and response.json()["object"] == "response"
    for body in ({"input": ["a", "b"]}, {"input": "a", "encoding_format": "float"}):
        r = client.request("POST", "/invocations", body)
        assert r.status_code == 200 and r.json()["data"][0]["object"] == "embedding", r.text
    r = client.request("POST", "/invocations", {"query": "a", "documents": ["b", "c"]})
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
    r = client.request("POST", "/invocations", {"text_1": "a", "text_2": "b"})
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "score", r.text
    r = client.request("POST", "/invocations", {"max_tokens": 4})
    assert r.status_code == 400 and "Cannot find suitable handler" in r.json()["error"]["message"]


def test_the_openai_client_creates_and_streams(client: Client):
    async def main() -> tuple[Any, list[Any]]:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            api = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            response = await api.responses.create(model="tiny", input="Hello", temperature=0,
                                                  max_output_tokens=6)
            stream = await api.responses.create(model="tiny", input="Hello", temperature=0,
                                                max_output_tokens=6, stream=True)
            return response, [event async for event in stream]

    response, streamed = asyncio.run(main())
    assert response.output_text and response.usage is not None and response.usage.output_tokens == 6
    assert streamed[-1].type == "response.completed"
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == \
        response.output_text


def test_a_reasoning_parser_gives_a_reasoning_item_streamed_and_not(engine: AsyncLLM):
    """--reasoning-parser on /v1/responses: the thinking is a `reasoning` item before the
    message (streamed as reasoning_text deltas that add up to it), and is left out of the
    conversation a later turn continues. The tiny model's answer is forced by a choice, which
    holds from the first token where thinking is off (qwen3's enable_thinking false: a
    constraint otherwise holds only after `</think>`), and qwen3's parser still splits an
    answer that opens with `<think>`."""
    from pagoda.server.reasoning import get_reasoning_parser

    client = Client(engine)
    client.ctx.reasoning_parser = get_reasoning_parser("qwen3")
    client.ctx.default_chat_template_kwargs = {"enable_thinking": False}
    body = {"input": "Think first.", "structured_outputs": {"choice": ["<think>plan it</think>yes"]},
            "max_output_tokens": 40}
    full = client.create(**body)
    kinds = [item["type"] for item in full["output"]]
    assert kinds == ["reasoning", "message"]
    assert full["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert output_text(full) == "yes"
    got = events(client.request("POST", "/v1/responses", {"model": "tiny", "temperature": 0, **body,
                                                          "stream": True}))
    thought = "".join(d["delta"] for name, d in got if name == "response.reasoning_text.delta")
    assert thought == "plan it"
    final = got[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == kinds and output_text(final) == "yes"
    assert [d["item"]["type"] for name, d in got if name == "response.output_item.done"] == kinds
    # NOTE: a client may send the reasoning item back; it is accepted and not prompted.
    again = client.create(input=[*full["output"], {"role": "user", "content": "Go on."}],
                          max_output_tokens=2)
    assert again["status"] in ("completed", "incomplete")
    stored = client.ctx.response_store.get(full["id"])
    assert stored is not None and all("plan it" not in str(m["content"]) for m in stored.messages)


def test_background_responses_are_polled_and_cancelled(client: Client):
    """OpenAI's background mode: "queued" at once, then GET gives the finished response (the
    same text as a synchronous one); cancel stops a long one ("cancelled", its engine requests
    aborted); a finished or synchronous response cannot be cancelled."""
    sync = client.create(input="Say hi")

    async def main() -> tuple[dict, dict, dict, int, int]:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"model": "tiny", "temperature": 0, "max_output_tokens": 8, "input": "Say hi", "background": True}
            queued = (await c.post("/v1/responses", json=body)).json()
            done = queued
            while done["status"] in ("queued", "in_progress"):
                await asyncio.sleep(0.02)
                done = (await c.get(f"/v1/responses/{queued['id']}")).json()
            long = (await c.post("/v1/responses", json={**body, "max_output_tokens": 400, "ignore_eos": True})).json()
            await asyncio.sleep(0.2)
            assert (await c.get(f"/v1/responses/{long['id']}")).json()["status"] == "in_progress"
            cancelled = (await c.post(f"/v1/responses/{long['id']}/cancel")).json()
            again = await c.post(f"/v1/responses/{long['id']}/cancel")
            finished = await c.post(f"/v1/responses/{done['id']}/cancel")
            # NOTE: the engine's abort is a task of this loop: let it run before the loop ends
            for _ in range(200):
                if client.engine.engine.num_unfinished_requests() == 0:
                    break
                await asyncio.sleep(0.01)
            return queued, done, cancelled, again.status_code, finished.status_code

    queued, done, cancelled, again, finished = asyncio.run(main())
    assert queued["status"] == "queued" and queued["output"] == []
    assert done["status"] == "incomplete" and output_text(done) == output_text(sync)
    assert cancelled["status"] == "cancelled" and again == 400 and finished == 400
    assert client.request("GET", f"/v1/responses/{cancelled['id']}").json()["status"] == "cancelled"
    assert client.engine.engine.num_unfinished_requests() == 0
    refused = client.request("POST", "/v1/responses", {"model": "tiny", "input": "x", "background": True, "store": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
    assert client.request("POST", "/v1/responses/resp_nope/cancel").status_code == 404
