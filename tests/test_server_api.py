"""Server paths a real engine seldom takes, in-process against a scripted fake engine.

An engine failure mid-stream (an SSE error event, then the server keeps serving), a failure
before any output, an unhealthy engine, plus the CLI's flag checks and the error wording.
The real-process tests live in test_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from pagoda.config import EngineConfig, LimitsConfig
from pagoda.input_processor import EngineRequest, InputProcessor
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server.api import build_app
from pagoda.server.errors import context_length_error
from pagoda.server.middleware import key_matches
from pagoda.server.serve import (
    add_serve_parser,
    banner,
    engine_kwargs,
    no_effect_lines,
    run_serve,
    unsupported_flag_error,
)
from pagoda.server.serving import ServerContext

REPO = Path(__file__).resolve().parents[1]
FAIL_MID_STREAM, FAIL_WITH_ERROR, FAIL_BEFORE_OUTPUT = 666, 667, 668


class FakeEngine:
    """Yields three one-token deltas; chosen seeds make it fail in different ways."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        limits = LimitsConfig().resolved(max_num_seqs=8, max_model_len=64)
        self.config = SimpleNamespace(model=SimpleNamespace(max_model_len=64), limits=limits)
        self.processor = InputProcessor(tokenizer, 49152, 64, limits)
        self.healthy = True
        self.dead_reason: str | None = None
        self.aborted: list[str] = []
        self.started: list[str] = []

    async def generate_request(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.started.append(req.request_id)
        seed = req.sampling_params.seed
        if seed == FAIL_BEFORE_OUTPUT:
            raise ValueError("The prompt is not acceptable.")
        for step in range(3):
            if step == 2 and seed == FAIL_MID_STREAM:
                raise RuntimeError("the engine exploded")
            last = step == 2
            delta = CompletionOutput(0, f"t{step} ", [100 + step],
                                     finish_reason="length" if last else None)
            error = "step failed" if last and seed == FAIL_WITH_ERROR else None
            yield RequestOutput(req.request_id, None, req.prompt_token_ids, [delta], last,
                                error=error)
            await asyncio.sleep(0)

    def check_queue(self, num_sequences: int) -> None:
        """Always room."""

    def record_rejection(self, reason: str) -> None:
        """Nothing to count."""

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def check_health(self) -> tuple[bool, str]:
        return self.healthy, "" if self.healthy else "engine thread died"

    def num_unfinished_requests(self) -> int:
        return 0


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer_dir: Path) -> FakeEngine:
    from transformers import AutoTokenizer

    return FakeEngine(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))


def call(engine: FakeEngine, method: str, path: str, request_id_headers: bool = False,
         **kwargs: object) -> httpx.Response:
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake",
                        max_model_len=64)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(ctx, request_id_headers=request_id_headers))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)  # type: ignore[arg-type]

    return asyncio.run(go())


def events(r: httpx.Response) -> list[object]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in r.text.splitlines() if line.startswith("data: ")]


def test_failure_mid_stream_is_an_sse_error_event(engine: FakeEngine):
    body = {"prompt": "hi", "stream": True, "seed": FAIL_MID_STREAM, "max_tokens": 5}
    r = call(engine, "POST", "/v1/completions", json=body)
    assert r.status_code == 200
    got = events(r)
    assert [e["choices"][0]["text"] for e in got[:2]] == ["t0 ", "t1 "]
    assert got[2]["error"]["code"] == 500 and "the engine exploded" in got[2]["error"]["message"]
    assert got[3] == "[DONE]"
    ok = call(engine, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "t0 t1 t2 "


def test_failures_without_a_stream(engine: FakeEngine):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    r = call(engine, "POST", "/v1/chat/completions", json={**chat, "seed": FAIL_WITH_ERROR})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert "step failed" in r.json()["error"]["message"]
    r = call(engine, "POST", "/v1/chat/completions", json={**chat, "seed": FAIL_BEFORE_OUTPUT})
    assert r.status_code == 400 and r.json()["error"]["message"] == "The prompt is not acceptable."
    r = call(engine, "POST", "/v1/chat/completions",
             json={**chat, "stream": True, "seed": FAIL_WITH_ERROR})
    assert [e for e in events(r) if isinstance(e, dict) and "error" in e]


def test_unhealthy_engine(engine: FakeEngine):
    engine.healthy = False
    try:
        r = call(engine, "GET", "/health")
    finally:
        engine.healthy = True
    assert r.status_code == 503 and "engine thread died" in r.json()["error"]["message"]


def test_openapi_lists_the_routes(engine: FakeEngine):
    paths = call(engine, "GET", "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version",
            "/tokenize", "/detokenize", "/metrics"} <= set(paths)


def test_context_length_wording():
    err = context_length_error(4096, 3500, 1000)
    assert err is not None and err.param == "max_tokens" and err.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 4500 tokens "
        "(3500 in the messages, 1000 in the completion). Please reduce the length of the "
        "messages or completion.")
    err = context_length_error(4096, 4096, None)
    assert err is not None and "you requested 4096 tokens in the messages" in err.message
    assert context_length_error(4096, 4095, None) is None
    assert context_length_error(4096, 4000, 96) is None


def test_key_matches():
    assert key_matches("b", ["a", "b"]) and not key_matches("c", ["a", "b"])
    assert not key_matches("", ["a"])


# ---- the CLI ------------------------------------------------------------------------------


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser


def test_serve_flags_map_to_engine_kwargs():
    args = serve_parser().parse_args([
        "serve", "some/model", "--max-model-len", "8K", "--kv-cache-memory", "4GiB",
        "--no-enable-prefix-caching", "--block-size", "32", "--api-key", "a", "b",
        "--api-key", "c", "--dtype", "float32", "--disable-log-stats"])
    assert args.model_tag == "some/model" and args.api_key == ["a", "b", "c"]
    assert engine_kwargs(args) == {"max_model_len": 8192, "kv_cache_memory": "4GiB",
                                   "enable_prefix_caching": False, "block_size": 32,
                                   "dtype": "float32", "log_stats": False}
    args = serve_parser().parse_args(["serve"])
    assert args.model_tag is None and args.host == "127.0.0.1" and args.port == 8000


def test_vllm_launch_flags_pagoda_needs_no_action_for_are_accepted():
    """Issue 26: a vLLM launch script passing these exited with "unrecognized arguments"."""
    args = serve_parser().parse_args(["serve", "m", "--enforce-eager", "--enable-prompt-tokens-details",
                                      "--scheduling-policy", "priority", "--grammar-compile-workers", "0"])
    assert args.enforce_eager and args.enable_prompt_tokens_details
    assert engine_kwargs(args) == {"scheduling_policy": "priority", "grammar_compile_workers": 0}


def test_vllm_flags_with_no_effect_are_accepted_and_each_named_once():
    args = serve_parser().parse_args([
        "serve", "m", "--trust-remote-code", "--disable-log-requests", "--no-enable-chunked-prefill",
        "--swap-space", "4", "--guided-decoding-backend", "xgrammar", "--distributed-executor-backend", "mp",
        "--enforce-eager", "--tokenizer-mode", "auto", "--max-seq-len-to-capture", "8192"])
    lines = no_effect_lines(args)
    assert len(lines) == 9
    assert any(line.startswith("--swap-space 4: ") and "recomputed" in line for line in lines)
    assert any(line.startswith("--no-enable-chunked-prefill: ") for line in lines)
    assert any(line.startswith("--enforce-eager: ") for line in lines)
    assert engine_kwargs(args) == {}  # none of them reaches the engine
    assert no_effect_lines(serve_parser().parse_args(["serve", "m"])) == []


def test_stream_interval_flag_is_the_floor_of_each_requests_own():
    """vLLM's --stream-interval reaches the scheduler config; a request's `stream_interval`
    raises it for itself and never lowers it (vLLM's clamp)."""
    from pagoda.output_processor import RequestState
    from pagoda.outputs import RequestMetrics
    from pagoda.sampling_params import SamplingParams

    args = serve_parser().parse_args(["serve", "m", "--stream-interval", "3"])
    assert engine_kwargs(args) == {"stream_interval": 3}
    assert EngineConfig.from_kwargs("m", **engine_kwargs(args)).scheduler.stream_interval == 3
    assert EngineConfig.from_kwargs("m").scheduler.stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig.from_kwargs("m", stream_interval=0)
    params = [SamplingParams(stream_interval=k) for k in (None, 2, 5)]
    state = RequestState("r", None, [1], params, RequestMetrics(arrival_time=0.0), None, stream_interval=3)
    assert [s.stream_interval for s in state.samples] == [3, 3, 5]


def test_logprobs_mode_reaches_the_model_config():
    args = serve_parser().parse_args(["serve", "m", "--logprobs-mode", "processed_logprobs"])
    assert EngineConfig.from_kwargs("m", **engine_kwargs(args)).model.logprobs_mode == "processed_logprobs"
    assert EngineConfig.from_kwargs("m").model.logprobs_mode == "raw_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig.from_kwargs("m", logprobs_mode="cooked")


def test_api_docs_can_be_turned_off(engine: FakeEngine):
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64)

    async def get(app: object, path: str) -> int:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get(path)).status_code

    for path in ("/docs", "/redoc", "/openapi.json"):
        assert asyncio.run(get(build_app(ctx), path)) == 200
        assert asyncio.run(get(build_app(ctx, api_docs=False), path)) == 404
    assert "docs:" not in banner("127.0.0.1", 8000, ctx, docs=False) and "docs:" in banner("127.0.0.1", 8000, ctx)


def test_request_id_headers_echo_the_clients_id_or_make_one(engine: FakeEngine):
    given = call(engine, "GET", "/v1/models", request_id_headers=True, headers={"X-Request-Id": "abc-1"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "abc-1"
    made = call(engine, "GET", "/v1/models", request_id_headers=True)
    refused = call(engine, "POST", "/v1/completions", request_id_headers=True, content=b"{")
    assert len(made.headers["x-request-id"]) == 32 and refused.status_code == 400
    assert refused.headers["x-request-id"] not in (made.headers["x-request-id"], "abc-1")
    assert "x-request-id" not in call(engine, "GET", "/v1/models").headers  # off by default


def test_response_ids_take_the_clients_request_id_as_vllm(engine: FakeEngine):
    """vLLM's: a response's id is `{prefix}-{X-Request-Id}`, else `{prefix}-{request_id}` (the
    body's), else a random one; the engine's id is made unique, so one id sent twice is fine."""
    comp = {"prompt": "hi", "max_tokens": 3}
    assert call(engine, "POST", "/v1/completions", json={**comp, "request_id": "job-7"}).json()["id"] == "cmpl-job-7"
    header = call(engine, "POST", "/v1/completions", json={**comp, "request_id": "job-7"},
                  headers={"X-Request-Id": "trace-1"})
    assert header.json()["id"] == "cmpl-trace-1"
    made = call(engine, "POST", "/v1/completions", json=comp).json()["id"]
    assert made.startswith("cmpl-") and len(made) == 5 + 32
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "request_id": "job-8"}
    assert call(engine, "POST", "/v1/chat/completions", json=body).json()["id"] == "chatcmpl-job-8"
    streamed = call(engine, "POST", "/v1/chat/completions", json={**body, "stream": True})
    assert {e["id"] for e in events(streamed) if e != "[DONE]"} == {"chatcmpl-job-8"}
    both = asyncio.run(_twice_at_once(engine, {**comp, "request_id": "same"}))
    assert [r.json()["id"] for r in both] == ["cmpl-same", "cmpl-same"]
    started = [rid for rid in engine.started if rid.startswith("cmpl-same-")]
    assert len(started) == 2 and len(set(started)) == 2


def test_add_special_tokens_reaches_the_tokenizer_as_vllm_defaults_it(engine: FakeEngine):
    """vLLM's field: a completion's text prompt gets the tokenizer's special tokens unless it
    says false; a chat's rendered template gets none unless it says true."""
    seen: list[bool] = []
    tokenize = engine.processor.tokenize

    def recording(text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        seen.append(add_special_tokens)
        return tokenize(text, add_special_tokens, param)

    engine.processor.tokenize = recording  # type: ignore[method-assign]
    comp = {"prompt": "hi", "max_tokens": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for path, body in (("/v1/completions", comp), ("/v1/completions", {**comp, "add_special_tokens": False}),
                       ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "add_special_tokens": True})):
        assert call(engine, "POST", path, json=body).status_code == 200
    assert seen == [True, False, False, True]


async def _twice_at_once(engine: FakeEngine, body: dict) -> list[httpx.Response]:
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64)
    transport = httpx.ASGITransport(app=build_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(2))))


def test_vllm_032_flags_start_or_refuse_by_what_they_ask():
    args = serve_parser().parse_args([
        "serve", "m", "--enable-hc-sp", "--prefix-match-unit", "32", "--renderer-num-workers", "4",
        "--fingerprint-mode", "none", "--no-enable-offline-docs", "--tool-strict-level", "auto",
        "--per-request-spec-decode-metrics", "none", "--log-error-stack"])
    lines = no_effect_lines(args)
    assert len(lines) == 5 and any(line.startswith("--prefix-match-unit 32: ") for line in lines)
    assert unsupported_flag_error(args) is None and args.log_error_stack
    for refused, why in ((["--use-fp64-gumbel"], "fp32 exponential"), (["--tool-strict-level", "function"], "tool_choice"),
                         (["-dc", "{}"], "diffusion"), (["--kv-cache-dtype-skip-layers", "0", "2"], "every layer")):
        message = unsupported_flag_error(serve_parser().parse_args(["serve", "m", *refused]))
        assert message is not None and why in message, refused


def test_error_responses_log_their_stack_when_asked(engine: FakeEngine, caplog: pytest.LogCaptureFixture):
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64)

    async def post(app: object) -> int:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                                "max_tokens": -1})).status_code

    with caplog.at_level("ERROR", logger="pagoda"):
        assert asyncio.run(post(build_app(ctx))) == 400
        assert not [r for r in caplog.records if r.exc_info]
        assert asyncio.run(post(build_app(ctx, log_error_stack=True))) == 400
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "POST /v1/completions answered 400" in logged[0].getMessage()


def test_log_config_file_is_applied_or_named(tmp_path: Path):
    import logging

    from pagoda.server.serve import apply_log_config

    good = tmp_path / "log.json"
    good.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                "loggers": {"pagoda.test_probe": {"level": "WARNING"}}}))
    assert apply_log_config(str(good)) is None
    assert logging.getLogger("pagoda.test_probe").level == logging.WARNING
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert "JSON object" in (apply_log_config(str(bad)) or "")
    assert apply_log_config(str(tmp_path / "missing.json")) is not None


def test_vllm_flags_pagoda_implements_under_vllms_names():
    args = serve_parser().parse_args([
        "serve", "m", "--kv-cache-memory-bytes", "1GiB", "--num-gpu-blocks-override", "64",
        "--max-logprobs", "-1", "--tokenizer", "smollm2", "--core-process", "--root-path", "/llm",
        "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--enable-request-id-headers",
        "--return-tokens-as-token-ids"])
    assert engine_kwargs(args) == {"kv_cache_memory": "1GiB", "num_kv_blocks": 64, "max_logprobs": -1,
                                   "tokenizer": "smollm2", "core_process": True}
    assert (args.root_path, args.ssl_keyfile, args.ssl_certfile) == ("/llm", "k.pem", "c.pem")
    assert args.enable_request_id_headers and args.return_tokens_as_token_ids
    config = EngineConfig.from_kwargs("m", **engine_kwargs(args))
    assert config.limits.max_logprobs == -1 and config.model.tokenizer == "smollm2"
    assert config.parallel.core_process


def test_middleware_flag_adds_classes_and_functions_by_import_path(engine, tmp_path, monkeypatch):
    """vLLM's --middleware: a class becomes ASGI middleware, an async function HTTP middleware;
    anything else, or a path that does not import, is a clear error before the model loads."""
    from pagoda.server.serve import add_middlewares, import_middleware

    (tmp_path / "my_mw.py").write_text(
        "class Tag:\n"
        "    def __init__(self, app):\n        self.app = app\n"
        "    async def __call__(self, scope, receive, send):\n"
        "        async def tagged(message):\n"
        "            if message['type'] == 'http.response.start':\n"
        "                message['headers'] = [*message['headers'], (b'x-class', b'1')]\n"
        "            await send(message)\n"
        "        await self.app(scope, receive, tagged)\n"
        "async def stamp(request, call_next):\n"
        "    response = await call_next(request)\n"
        "    response.headers['x-function'] = request.url.path\n"
        "    return response\n"
        "NOT_ONE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = serve_parser().parse_args(["serve", "m", "--middleware", "my_mw.Tag", "--middleware", "my_mw.stamp"])
    found = [import_middleware(p) for p in args.middleware]
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64)
    app = build_app(ctx)
    add_middlewares(app, found)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/version")

    r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["x-class"] == "1" and r.headers["x-function"] == "/version"
    for bad, why in [("my_mw.NOT_ONE", "expected an ASGI middleware"), ("my_mw.missing", "cannot import"),
                     ("no_such_module.X", "cannot import")]:
        with pytest.raises(ValueError, match=why):
            import_middleware(bad)


def test_vllms_tls_and_h11_flags_reach_uvicorn():
    import ssl

    import uvicorn

    from pagoda.server.serve import uvicorn_tls_kwargs

    args = serve_parser().parse_args(["serve", "m", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2",
                                      "--ssl-ciphers", "ECDHE+AESGCM", "--h11-max-incomplete-event-size", "65536"])
    kwargs = uvicorn_tls_kwargs(args)
    assert kwargs == {"ssl_cert_reqs": int(ssl.CERT_REQUIRED), "ssl_ca_certs": "ca.pem",
                      "ssl_ciphers": "ECDHE+AESGCM", "h11_max_incomplete_event_size": 65536, "http": "h11"}
    config = uvicorn.Config(app=None, **kwargs)  # type: ignore[arg-type]
    assert config.ssl_cert_reqs == ssl.CERT_REQUIRED and config.h11_max_incomplete_event_size == 65536
    assert config.http == "h11"  # NOTE: the limit is h11's; httptools (uvicorn's pick otherwise) would drop it
    assert uvicorn_tls_kwargs(serve_parser().parse_args(["serve", "m"])) == {"ssl_cert_reqs": 0}


def test_access_log_lines_can_leave_out_some_paths():
    import logging

    from pagoda.server.serve import AccessLogFilter

    args = serve_parser().parse_args(["serve", "m", "--disable-access-log-for-endpoints", "/health, /metrics"])
    assert args.disable_access_log_for_endpoints == "/health, /metrics"
    quiet = AccessLogFilter(["/health", "/metrics"])

    def line(path: str, name: str = "uvicorn.access") -> logging.LogRecord:
        return logging.LogRecord(name, logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert not quiet.filter(line("/health")) and not quiet.filter(line("/metrics?x=1"))
    assert quiet.filter(line("/v1/models")) and quiet.filter(line("/health", "pagoda.serve"))


@pytest.mark.parametrize("argv, logged, refused", [
    (["--moe-backend", "triton", "--enable-dbo", "--cpu-offload-params", "a", "b"],
     ["--moe-backend triton", "--enable-dbo", "--cpu-offload-params ['a', 'b']"], None),
    (["--data-parallel-rank", "0", "--data-parallel-backend", "mp", "--decode-context-parallel-size", "1"], [], None),
    (["--data-parallel-external-lb"], [], "--data-parallel-external-lb: one server is one engine"),
    (["--tool-parser-plugin", "my_parser.py"], [], "--tool-parser-plugin: plugins are not loaded"),
    (["--lora-dtype", "bfloat16"], [], "--lora-dtype: only text LoRA adapters in the model's dtype"),
])
def test_vllm_032_launch_flags_are_accepted_or_refused_by_name(argv, logged, refused):
    from pagoda.server.serve import unsupported_flag_error

    args = serve_parser().parse_args(["serve", "m", *argv])
    assert [line.split(":")[0] for line in no_effect_lines(args)] == logged
    assert (unsupported_flag_error(args) or "").startswith(refused or "")
    assert (unsupported_flag_error(args) is None) == (refused is None)


def test_log_level_sets_pagodas_logger(monkeypatch):
    import logging

    from pagoda.server import serve

    args = serve_parser().parse_args(["serve", "/nonexistent/model", "--log-level", "WARNING"])
    assert args.log_level == "warning"
    monkeypatch.setattr(logging.getLogger("pagoda"), "level", logging.NOTSET)
    monkeypatch.setattr(serve, "_serve", lambda *a: None)
    monkeypatch.setattr(serve, "run_event_loop", lambda coro: 0)
    assert serve.run_serve(args) == 0
    assert logging.getLogger("pagoda").level == logging.WARNING


def test_vllms_speculative_shorthands_and_shutdown_timeout():
    from pagoda.server.serve import unsupported_flag_error

    args = serve_parser().parse_args(["serve", "m", "--spec-method", "ngram", "--spec-tokens", "3",
                                      "--speculative-config", '{"prompt_lookup_max": 2}', "--shutdown-timeout", "0"])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 2}
    assert args.drain_timeout == 0
    config = EngineConfig.from_kwargs("m", **engine_kwargs(args))
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 3
    clash = serve_parser().parse_args(["serve", "m", "--spec-tokens", "3", "--speculative-config",
                                       '{"method": "ngram", "num_speculative_tokens": 4}'])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_kwargs(clash)
    assert unsupported_flag_error(serve_parser().parse_args(["serve", "m", "--worker-cls", "auto"])) is None
    # NOTE: --logprobs-mode is served now (every mode; tests/test_sampler.py)
    assert unsupported_flag_error(serve_parser().parse_args(["serve", "m", "--logprobs-mode", "processed_logprobs"])) is None
    assert "workers are pagoda's own" in str(
        unsupported_flag_error(serve_parser().parse_args(["serve", "m", "--worker-cls", "my.Worker"])))


def test_custom_histogram_buckets_flag_parsed_and_checked(capsys: pytest.CaptureFixture[str]):
    args = serve_parser().parse_args(["serve", "m", "--custom-histogram-buckets", '{"request_latency": [0.1, 1]}'])
    assert args.custom_histogram_buckets == {"request_latency": [0.1, 1.0]}
    assert serve_parser().parse_args(["serve", "m"]).custom_histogram_buckets is None
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "m", "--custom-histogram-buckets", '{"request_latency": [1, 0.1]}'])
    assert "strictly increasing" in capsys.readouterr().err


def test_vllms_admission_knobs_reach_the_scheduler():
    args = serve_parser().parse_args(["serve", "m", "--max-num-scheduled-tokens", "1k", "--max-num-active-seqs", "4",
                                      "--watermark", "0.01", "--scheduler-reserve-full-isl"])
    scheduler = EngineConfig.from_kwargs("m", **engine_kwargs(args)).scheduler
    assert (scheduler.max_num_scheduled_tokens, scheduler.max_num_active_seqs, scheduler.watermark,
            scheduler.scheduler_reserve_full_isl) == (1000, 4, 0.01, True)
    default = EngineConfig.from_kwargs("m").scheduler
    assert (default.max_num_scheduled_tokens, default.max_num_active_seqs, default.watermark,
            default.scheduler_reserve_full_isl) == (None, None, 0.0, False)


def test_long_prefill_token_threshold_reaches_the_scheduler():
    args = serve_parser().parse_args(["serve", "m", "--long-prefill-token-threshold", "256"])
    assert EngineConfig.from_kwargs("m", **engine_kwargs(args)).scheduler.long_prefill_token_threshold == 256
    assert EngineConfig.from_kwargs("m").scheduler.long_prefill_token_threshold == 0


def test_partial_prefill_flags_reach_the_scheduler():
    """vLLM's --max-num-partial-prefills / --max-long-partial-prefills (its V1 refuses more than
    1 at start): taken, with V0's 4%-of-the-context threshold when none is given, and checked."""
    args = serve_parser().parse_args(["serve", "m", "--max-num-partial-prefills", "4",
                                      "--max-long-partial-prefills", "2"])
    scheduler = EngineConfig.from_kwargs("m", **engine_kwargs(args)).with_max_model_len(8192).scheduler
    assert (scheduler.max_num_partial_prefills, scheduler.max_long_partial_prefills) == (4, 2)
    assert scheduler.prefill_chunk_tokens == 327 and scheduler.long_prefill_token_threshold == 0
    default = EngineConfig.from_kwargs("m").with_max_model_len(8192).scheduler
    assert (default.max_num_partial_prefills, default.prefill_chunk_tokens) == (1, 0)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig.from_kwargs("m", max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        EngineConfig.from_kwargs("m", max_num_partial_prefills=0)


def test_vllms_master_addr_and_port_are_the_rendezvous_address():
    args = serve_parser().parse_args(["serve", "m", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5"])
    assert engine_kwargs(args)["dist_init_addr"] == "10.0.0.5:29501"
    args = serve_parser().parse_args(["serve", "m", "--master-port", "4000", "--dist-init-addr", "h:1"])
    assert engine_kwargs(args)["dist_init_addr"] == "h:1"  # NOTE: pagoda's own flag wins
    assert "dist_init_addr" not in engine_kwargs(serve_parser().parse_args(["serve", "m"]))


def test_vllm_spellings_start_as_vllm_would():
    """vLLM's parser takes `--max_model_len` for `--max-model-len`, `--no-X` for every boolean
    flag, and short spellings such as `-O`; a launch script using them must not exit with
    "unrecognized arguments"."""
    from pagoda.server.serve import vllm_spelling

    argv = vllm_spelling(["serve", "m", "--max_model_len", "4096", "--enable_prefix_caching", "--max-num-batched-tokens", "2k",
                          "--served_model_name=my_model", "--no-enforce-eager", "--no-trust-remote-code",
                          "-O3", "--max-log-len", "100", "--async-scheduling", "--disable-uvicorn-access-log"])
    assert argv[2:4] == ["--max-model-len", "4096"] and "--served-model-name=my_model" in argv
    args = serve_parser().parse_args(argv)
    assert args.served_model_name == ["my_model"] and args.disable_uvicorn_access_log
    assert engine_kwargs(args) == {"max_model_len": 4096, "enable_prefix_caching": True, "max_num_batched_tokens": 2000}
    lines = no_effect_lines(args)
    assert [line.split(":")[0] for line in lines] == [
        "--no-enforce-eager", "--no-trust-remote-code", "--async-scheduling", "--compilation-config 3"]
    assert args.max_log_len == 100  # NOTE: the request log's (--enable-log-requests)
    assert vllm_spelling(["--api-key", "a_b", "--", "--x_y"]) == ["--api-key", "a_b", "--", "--x_y"]


def test_more_of_vllms_launch_flags_start_and_are_named_in_the_log():
    """Flags of vLLM 0.32's serve parser that change nothing here start the server (a launch
    script must not exit with "unrecognized arguments") and are each named at start."""
    argv = ["serve", "m", "--numa-bind", "-ep", "--ignore-patterns", "original/**", "*.pth",
            "--language-model-only", "--no-kv-cache-metrics", "--mamba-cache-dtype", "float32",
            "--no-disable-sliding-window", "--uds", ""]
    args = serve_parser().parse_args(argv)
    assert [line.split(":")[0] for line in no_effect_lines(args)] == [
        "--language-model-only", "--numa-bind", "--enable-expert-parallel",
        "--ignore-patterns ['original/**', '*.pth']", "--no-kv-cache-metrics", "--mamba-cache-dtype float32"]
    from pagoda.server.serve import unsupported_flag_error

    assert unsupported_flag_error(args) is None  # NOTE: asked for none of the missing features


def test_every_spelling_of_vllms_serve_flags_parses():
    """vLLM 0.32's serve parser spells some flags in several ways (`--no-X` for its boolean
    flags, short aliases, `--device-memory-utilization`); each parses here as the flag it names,
    and the refused ones are still refused under their short spelling."""
    from pagoda.server.serve import unsupported_flag_error

    argv = ["serve", "m", "--no-trust-request-chat-template", "--no-return-tokens-as-token-ids",
            "--no-enable-auto-tool-choice", "--no-allow-credentials", "--no-enable-request-id-headers",
            "--no-disable-fastapi-docs", "--no-disable-hybrid-kv-cache-manager", "-n", "1", "-r", "0",
            "-dcp", "1", "-pcp", "1", "-dpn", "0", "-dpr", "0", "-dpl", "1", "-dpb", "mp",
            "--device-memory-utilization", "0.5", "-sc", '{"method": "ngram"}', "-cc", "{}", "-ac", "{}",
            "--h11-max-header-count", "256"]
    args = serve_parser().parse_args(argv)
    assert args.nnodes == 1 and args.node_rank == 0 and args.gpu_memory_utilization == 0.5
    assert args.speculative_config == '{"method": "ngram"}' and args.disable_hybrid_kv_cache_manager is False
    assert not (args.trust_request_chat_template or args.enable_auto_tool_choice or args.disable_fastapi_docs)
    assert unsupported_flag_error(args) is None  # NOTE: each asks for what pagoda does anyway
    for refused, flag in ((["-dpn", "1"], "--data-parallel-rank"), (["-dcp", "2"], "--decode-context-parallel-size"),
                          (["-dpe"], "--data-parallel-external-lb"), (["-dpa", "10.0.0.1"], "--data-parallel-address")):
        error = unsupported_flag_error(serve_parser().parse_args(["serve", "m", *refused]))
        assert error is not None and error.startswith(flag + ":")


def test_vllms_dotted_config_keys_and_dtype_spellings_parse():
    """vLLM's parser takes a JSON config flag key by key (`--structured-outputs-config.backend
    xgrammar`, merged into one object; `key+` a comma list) and `--dtype half|float`: vLLM's own
    function-calling tests start their server so."""
    from pagoda.config import ModelConfig
    from pagoda.server.serve import vllm_spelling

    argv = vllm_spelling(["serve", "m", "--dtype", "half", "--structured-outputs-config.backend", "xgrammar",
                          "--compilation-config.mode=3", "--compilation_config.pass_config.fuse+", "a,b",
                          "--kv-transfer-config.kv_buffer_size", "1e9", "--max_model_len", "1k"])
    assert argv[-6:] == ["--structured-outputs-config", '{"backend": "xgrammar"}', "--compilation-config",
                         '{"mode": 3, "pass_config": {"fuse": ["a", "b"]}}', "--kv-transfer-config",
                         '{"kv_buffer_size": 1000000000.0}']
    args = serve_parser().parse_args(argv)
    assert args.dtype == "half" and args.structured_outputs_config == '{"backend": "xgrammar"}'
    assert engine_kwargs(args)["max_model_len"] == 1000
    assert ModelConfig(dtype="half").dtype == "float16" and ModelConfig(dtype="float").dtype == "float32"
    assert vllm_spelling(["--served_model_name=a.b", "--api-key", "x.y", "--", "--a.b", "c"]) == [
        "--served-model-name=a.b", "--api-key", "x.y", "--", "--a.b", "c"]


@pytest.mark.parametrize(("fast", "env", "expected"), [
    (True, None, torch.bfloat16), (True, "keep", torch.float16), (False, None, torch.float16)])
def test_float16_on_a_cpu_runs_as_bfloat16_where_bf16_is_fast(fast, env, expected, monkeypatch, caplog):
    """A GPU launch script's `--dtype half` on a CPU whose kernels compute bf16: bfloat16 (float16
    would run layer by layer, 3-5x slower), said in a warning; PAGODA_CPU_FLOAT16=keep keeps it;
    a CPU without fast bf16 keeps float16. Other dtypes are as asked."""
    import pagoda.engine_setup as setup

    monkeypatch.setattr(setup, "_cpu_bf16_is_fast", lambda: fast)
    if env is None:
        monkeypatch.delenv(setup.KEEP_FLOAT16_ENV, raising=False)
    else:
        monkeypatch.setenv(setup.KEEP_FLOAT16_ENV, env)
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="pagoda"):
        assert setup.resolve_dtype("float16", cpu, None) == expected
    assert ("runs as bfloat16" in caplog.text) == (expected == torch.bfloat16)
    assert setup.resolve_dtype("float32", cpu, None) == torch.float32
    assert setup.resolve_dtype("auto", cpu, None) == (torch.bfloat16 if fast else torch.float32)


def test_a_yaml_config_file_gives_flags_that_the_command_line_overrides(tmp_path):
    """vLLM's `--config FILE.yaml`: keys are flags (underscores or dashes), booleans switch,
    lists and mappings pass as vLLM passes them, the command line wins, `model:` serves when
    the command line names none; a wrong file is a clear error, not a traceback."""
    from pagoda.cli import build_parser, negatable_flags
    from pagoda.server.config_file import expand_config_file
    from pagoda.server.serve import vllm_spelling

    config = tmp_path / "serve.yaml"
    config.write_text("model: smollm2\nmax_model_len: 4096\nport: 9000\nenable-prefix-caching: false\n"
                      "served-model-name: [a, b]\nhf-overrides: {rope_theta: 1000000.0}\n"
                      "enforce-eager: true\n")
    negatable = negatable_flags(build_parser(), "serve")

    def parse(*argv: str) -> argparse.Namespace:
        return serve_parser().parse_args(vllm_spelling(expand_config_file(["serve", *argv], negatable)))

    args = parse("--config", str(config), "--port", "8001")
    assert (args.model, args.port, args.served_model_name) == ("smollm2", 8001, ["a", "b"])
    assert engine_kwargs(args) == {"max_model_len": 4096, "enable_prefix_caching": False,
                                   "hf_overrides": {"rope_theta": 1e6}}
    assert args.enforce_eager is True
    assert parse("m", f"--config={config}").model_tag == "m"
    assert expand_config_file(["bench", "--config", "x"], negatable) == ["bench", "--config", "x"]
    for bad, why in [("x.json", "must be a .yaml"), (str(tmp_path / "none.yaml"), "cannot read")]:
        with pytest.raises(ValueError, match=why):
            expand_config_file(["serve", "--config", bad], negatable)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        expand_config_file(["serve", "--config", str(tmp_path / "list.yaml")], negatable)
    with pytest.raises(ValueError, match="more than one"):
        expand_config_file(["serve", "--config", "a.yaml", "--config", "b.yaml"], negatable)


def test_hf_overrides_and_vllms_older_rope_flags_reach_the_model_config():
    args = serve_parser().parse_args(["serve", "m", "--rope-theta", "5e5", "--rope-scaling",
                                      '{"rope_type": "linear", "factor": 2}', "--hf-overrides",
                                      '{"max_position_embeddings": 65536, "rope_theta": 1e6}'])
    kwargs = engine_kwargs(args)
    assert kwargs == {"hf_overrides": {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2},
                                       "max_position_embeddings": 65536}}
    assert EngineConfig.from_kwargs("m", **kwargs).model.hf_overrides == kwargs["hf_overrides"]
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "m", "--hf-overrides", "{not json"])


@pytest.mark.parametrize("argv, refused", [
    (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras: LoRA adapters are served in one process"),
    (["--data-parallel-size", "2"], "--data-parallel-size: one server is one engine"),
    (["-dp", "4"], "--data-parallel-size: one server is one engine"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb: weights are not offloaded"),
    (["--enable-sleep-mode"], "--enable-sleep-mode: sleep mode"),
    (["--logits-processors", "my.Processor"], "--logits-processors: custom logits processors"),
    (["--uds", "/tmp/s.sock"], "--uds: the server listens on TCP"),
    (["--disable-sliding-window"], "--disable-sliding-window: sliding-window layers always attend"),
    (["--otlp-traces-endpoint", "http://x:4317"], "--otlp-traces-endpoint: OpenTelemetry tracing"),
])
def test_vllm_features_pagoda_lacks_are_refused_at_start(argv: list[str], refused: str,
                                                         capsys: pytest.CaptureFixture[str]):
    args = serve_parser().parse_args(["serve", "m", *argv])
    assert run_serve(args) == 2
    assert refused in capsys.readouterr().err
    # NOTE: the values that ask for nothing start as usual (here: up to loading the model).
    harmless = serve_parser().parse_args(["serve", "m", "--data-parallel-size", "1", "--cpu-offload-gb", "0.0",
                                          "-asc", "1", "--no-enable-lora", "--no-enable-sleep-mode"])
    assert unsupported_flag_error(harmless) is None


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--block-size", "7"], "invalid choice"),
    (["--kv-cache-memory", "lots"], "a size must look like"),
    (["--port", "99999"], "must be an integer in [0, 65535]"),
    (["--max-model-len", "big"], "expected an integer like 2048 or 8k"),
])
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        serve_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be at least 1"),
    (["--nnodes", "2", "-tp", "2"], "dist_init_addr"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["m1", "--model", "m2"], "two models given"),
])
def test_bad_values_fail_before_loading(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]):
    assert run_serve(serve_parser().parse_args(["serve", *argv])) == 2
    assert message in capsys.readouterr().err


def test_entrypoint_rejects_unknown_flag():
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--bogus"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


def test_entrypoint_takes_every_spelling_serve_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM's old entry point reads the flags as `pagoda serve` does: underscores, dotted config
    keys, and a --config file."""
    from pagoda.entrypoints.openai import api_server

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(api_server, "run_serve", lambda args: seen.append(args) or 0)
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 7\n")
    assert api_server.main(["--model", "m", "--max_model_len", "512", "--watermark-config.key", "5",
                            "--config", str(config)]) == 0
    args = seen[0]
    assert (args.max_model_len, args.max_num_seqs, json.loads(args.watermark_config)) == (512, 7, {"key": 5})


def test_unloadable_model_exits_1(capsys: pytest.CaptureFixture[str]):
    assert run_serve(serve_parser().parse_args(["serve", "/nonexistent/model"])) == 1
    assert "cannot load '/nonexistent/model'" in capsys.readouterr().err


def test_cors_only_where_the_flags_allow(engine: FakeEngine):
    """vLLM's --allowed-origins: a browser's preflight is answered before the API key is asked
    for; without the flag no CORS headers (vLLM would allow every origin)."""
    from pagoda.server.api import CorsPolicy
    from pagoda.server.serve import cors_policy

    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64,
                        api_keys=["k"])
    preflight = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def options(app: object, origin: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.options("/v1/chat/completions", headers={**preflight, "Origin": origin})

    args = serve_parser().parse_args(["serve", "m", "--allowed-origins", '["https://a.example"]'])
    policy = cors_policy(args)
    assert policy == CorsPolicy(["https://a.example"])
    allowed = asyncio.run(options(build_app(ctx, cors=policy), "https://a.example"))
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://a.example"
    other = asyncio.run(options(build_app(ctx, cors=policy), "https://b.example"))
    assert "access-control-allow-origin" not in other.headers
    assert cors_policy(serve_parser().parse_args(["serve", "m"])) is None
    closed = asyncio.run(options(build_app(ctx), "https://a.example"))
    assert "access-control-allow-origin" not in closed.headers
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "m", "--allowed-origins", "https://a.example"])


def test_root_path_routes_answer_with_and_without_the_prefix_and_keys_still_hold(
        engine: FakeEngine, monkeypatch: pytest.MonkeyPatch):
    """vLLM's --root-path (FastAPI's root_path): /llm/v1/models and /v1/models both answer, the
    API key is asked for on both, /health is open on both; VLLM_API_KEY is the key where no
    --api-key is given (vLLM's test_root_path)."""
    from pagoda.server.serve import api_keys

    monkeypatch.setenv("VLLM_API_KEY", "abc-123")
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    assert api_keys(serve_parser().parse_args(["serve", "m"])) == ["abc-123"]
    assert api_keys(serve_parser().parse_args(["serve", "m", "--api-key", "k"])) == ["k"]
    ctx = ServerContext(engine=engine, served_model_names=["fake"], model_path="fake", max_model_len=64,
                        api_keys=["abc-123"])

    async def get(path: str, key: str | None) -> int:
        transport = httpx.ASGITransport(app=build_app(ctx, root_path="/llm"))  # type: ignore[arg-type]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get(path, headers=headers)).status_code

    for prefix in ("", "/llm"):
        assert asyncio.run(get(f"{prefix}/v1/models", "abc-123")) == 200
        assert asyncio.run(get(f"{prefix}/v1/models", "abc")) == 401
        assert asyncio.run(get(f"{prefix}/health", None)) == 200
