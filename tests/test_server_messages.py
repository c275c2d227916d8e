"""Anthropic's Messages API (server/messages.py), in-process over the tiny random Llama."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import test_health as health

from pagoda.async_engine import AsyncLLM
from pagoda.server.messages import chat_request_of, stop_reason_of
from pagoda.server.messages_protocol import AnthropicMessagesRequest

WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(tiny_llama, None, dtype="float32", num_kv_blocks=64, max_model_len=512)
    yield eng
    eng.shutdown()


def ask(**extra: object) -> dict:
    return {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}], **extra}


def events(r: httpx.Response) -> list[tuple[str, dict]]:
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_message_answers_in_anthropics_shape(engine: AsyncLLM):
    r = health.post(engine, "/v1/messages", ask(system="Be brief."))
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"][0]["type"] == "text" and message["content"][0]["text"]
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    counted = health.post(engine, "/v1/messages/count_tokens", {"model": "tiny", "system": "Be brief.",
                                                               "messages": ask()["messages"]}).json()
    usage = message["usage"]
    assert usage["output_tokens"] == 6
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] \
        == counted["input_tokens"]
    chat = health.post(engine, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "max_tokens": 6, "temperature": 0}).json()
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_the_stream_is_anthropics_events_and_the_same_text(engine: AsyncLLM):
    whole = health.post(engine, "/v1/messages", ask()).json()
    got = events(health.post(engine, "/v1/messages", ask(stream=True)))
    names = [name for name, _ in got]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in got)
    text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    delta = got[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6
    def prompt(usage: dict) -> int:
        return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]

    assert got[0][1]["message"]["usage"] == {"input_tokens": prompt(whole["usage"]), "output_tokens": 0}
    assert prompt(whole["usage"]) == prompt(delta["usage"])


def test_usage_counts_prefix_cache_reads_and_writes_as_vllm(engine: AsyncLLM):
    body = ask(max_tokens=1, messages=[{"role": "user", "content": "Cache coverage sentinel. " * 30}])
    cold = health.post(engine, "/v1/messages", body).json()["usage"]
    warm = health.post(engine, "/v1/messages", body).json()["usage"]
    # NOTE: the chat template's first block may be cached by the tests before: reads grow
    assert cold["cache_creation_input_tokens"] > 0 and warm["cache_creation_input_tokens"] == 0
    assert warm["cache_read_input_tokens"] == cold["cache_read_input_tokens"] + cold["cache_creation_input_tokens"]
    assert sum(cold[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")) == \
        sum(warm[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


def test_a_forced_tool_is_a_tool_use_block(engine: AsyncLLM):
    body = ask(max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    message = health.post(engine, "/v1/messages", body).json()
    calls = [b for b in message["content"] if b["type"] == "tool_use"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and isinstance(calls[0]["input"]["city"], str)
    assert message["stop_reason"] == "tool_use"
    got = events(health.post(engine, "/v1/messages", {**body, "stream": True}))
    starts = [d["content_block"] for n, d in got if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "get_weather"
    args = "".join(d["delta"]["partial_json"] for n, d in got if n == "content_block_delta")
    assert json.loads(args) == calls[0]["input"]
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_blocks_become_the_chat_messages_vllm_makes():
    req = AnthropicMessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Sys."}],
        "tools": [WEATHER], "tool_choice": {"type": "any"}, "stop_sequences": ["END"],
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "Sunny"}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]})
    chat = chat_request_of(req)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[0] == {"role": "system", "content": "Sys."}
    assert messages[2]["reasoning"] == "Use the tool."
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}
    assert messages[4] == {"role": "user", "content": "And tomorrow?"}
    assert chat.tool_choice == "required" and chat.stop == ["END"] and chat.reasoning_effort == "none"
    assert chat.tools is not None and chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert stop_reason_of("stop", "END", False, False) == ("stop_sequence", "END")
    assert stop_reason_of("length", None, True, True) == ("max_tokens", None)


def test_errors_have_anthropics_shape(engine: AsyncLLM):
    missing = health.post(engine, "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400
    body = missing.json()
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"]
    image = ask(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}])
    r = health.post(engine, "/v1/messages", image)
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
    assert health.post(engine, "/v1/messages", ask(model="nope")).status_code == 404
    long = health.post(engine, "/v1/messages", ask(max_tokens=10**6))
    assert long.status_code == 400 and long.json()["type"] == "error"


STRICT = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('System role only at the start') }}{% endif %}"
          "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_mid_conversation_system_merges_only_where_the_template_refuses_it(engine: AsyncLLM):
    """vLLM's probe: a template that raises on a later system message gets it merged into the
    first (the request then answers); one that takes it keeps it in place."""
    import asyncio

    inline = {"model": "tiny", "max_tokens": 2, "system": "A.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "B."}, {"role": "user", "content": "Go"}]}
    merged = {**inline, "system": "A.B.", "messages": [inline["messages"][0], inline["messages"][2]]}

    def count(body: dict, **ctx: object) -> httpx.Response:
        async def main() -> httpx.Response:
            async with health.app_client(engine, **ctx) as client:
                return await client.post("/v1/messages/count_tokens", json=body)
        return asyncio.run(main())

    strict = {"chat_template": STRICT}
    assert count(inline, **strict).json() == count(merged, **strict).json()
    kept, joined = count(inline).json(), count(merged).json()
    assert kept != joined  # NOTE: SmolLM2's template takes the system message where it is
