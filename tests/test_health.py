"""Health that tells the truth, and failures that stay contained, on a real AsyncLLM.

In-process: the FastAPI app over AsyncLLM serving the tiny random Llama, through httpx's ASGI
transport. The engine's step or its runner is monkeypatched to stall, die or fail once.
States: healthy; stalled (work pending, no step for `stall_timeout`) and back; dead (the loop
raised); one failed runner step, which fails only its requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pagoda.async_engine import AsyncLLM
from pagoda.config import EngineConfig
from pagoda.metrics import PrometheusStatLogger
from pagoda.server.api import build_app
from pagoda.server.serve import _load_engine, add_serve_parser
from pagoda.server.serving import ServerContext

PROMPT = [5, 6, 7, 8]
ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
BODY = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def make_engine(model: Path, registry: CollectorRegistry | None = None,
                **engine_args: object) -> AsyncLLM:
    """A real AsyncLLM over `model` (ENGINE_ARGS, or `engine_args` when given)."""
    args = engine_args or ENGINE_ARGS
    loggers = []
    if registry is not None:
        config = EngineConfig.from_kwargs(str(model), **args)
        loggers.append(PrometheusStatLogger("tiny", config, registry=registry))
    return AsyncLLM.from_engine_args(str(model), stat_loggers=loggers, **args)


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, registry: CollectorRegistry) -> Iterator[AsyncLLM]:
    eng = make_engine(tiny_llama, registry)
    yield eng
    eng.shutdown()


@contextlib.asynccontextmanager
async def app_client(engine: AsyncLLM, **ctx_args: object) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client of the app over `engine`, in-process (ASGI)."""
    ctx = ServerContext(engine=engine, served_model_names=["tiny"], model_path="tiny",
                        max_model_len=engine.config.model.max_model_len, **ctx_args)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
        yield c


def post(engine: AsyncLLM, path: str, body: dict) -> httpx.Response:
    """One JSON POST to the app over `engine`, in-process."""

    async def main() -> httpx.Response:
        async with app_client(engine) as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


async def wait_unhealthy(engine: AsyncLLM, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        healthy, reason = engine.check_health()
        if not healthy:
            return reason
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine stayed healthy for {timeout} s")


def sse_events(r: httpx.Response) -> list[dict | str]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in r.text.splitlines() if line.startswith("data: ")]


def error_count(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("vllm:request_success_total",
                                      {"model_name": "tiny", "engine": "0",
                                       "finished_reason": reason})
    return value or 0.0


def test_healthy_engine(engine: AsyncLLM):
    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with app_client(engine) as client:
            done = await client.post("/v1/completions", json=BODY)
            return done, await client.get("/health")

    done, health = asyncio.run(main())
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
    assert health.status_code == 200 and engine.check_health() == (True, "ok")


def test_stalled_engine_is_unhealthy_until_it_steps(engine: AsyncLLM,
                                                    monkeypatch: pytest.MonkeyPatch):
    gate = threading.Event()
    step = engine.engine.step

    def blocked_step() -> list:
        gate.wait(20)
        return step()

    monkeypatch.setattr(engine.engine, "step", blocked_step)
    monkeypatch.setattr(engine, "stall_timeout", 0.2)

    async def main() -> tuple[str, httpx.Response, httpx.Response, httpx.Response]:
        async with app_client(engine) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=BODY))
            try:
                reason = await wait_unhealthy(engine)
                stalled = await client.get("/health")
            finally:
                gate.set()
            done = await pending
            return reason, stalled, done, await client.get("/health")

    reason, stalled, done, recovered = asyncio.run(main())
    assert "has pending requests but has not stepped for" in reason
    assert "stall timeout 0.2 s" in reason
    assert stalled.status_code == 503
    error = stalled.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "has not stepped" in error["message"]
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
    assert recovered.status_code == 200 and engine.check_health() == (True, "ok")


def test_dead_engine_loop(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    engine = make_engine(tiny_llama)

    def broken_step() -> list:
        raise RuntimeError("scheduler invariant broken")

    monkeypatch.setattr(engine.engine, "step", broken_step)

    async def main() -> list[httpx.Response]:
        async with app_client(engine) as client:
            in_flight = await client.post("/v1/completions", json=BODY)
            return [in_flight, await client.get("/health"),
                    await client.post("/v1/completions", json=BODY),
                    await client.post("/v1/completions", json={**BODY, "stream": True}),
                    await client.get("/v1/models"), await client.get("/kv_cache")]

    try:
        in_flight, health, after, streamed, models, kv = asyncio.run(main())
    finally:
        engine.shutdown()
    for r in (in_flight, after):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert error["message"] == ("The engine is not running: "
                                    "RuntimeError: scheduler invariant broken")
    assert health.status_code == 503
    assert "engine loop is dead: RuntimeError: scheduler invariant broken" in (
        health.json()["error"]["message"])
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and isinstance(events[0], dict)
    assert events[0]["error"]["code"] == 503
    assert models.status_code == 200 and kv.status_code == 200
    assert engine.check_health()[0] is False


class FailOnce:
    """Stands in for `runner.execute`: raises on the first call, then defers to the original."""

    def __init__(self, execute: object) -> None:
        self.execute = execute
        self.failed = False

    def __call__(self, sched: object) -> object:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected runner failure")
        return self.execute(sched)  # type: ignore[operator]


@pytest.mark.parametrize("stream", [False, True])
def test_failed_step_fails_its_requests_and_the_engine_serves_on(
        engine: AsyncLLM, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        stream: bool):
    runner = engine.engine.runner
    errors_before = error_count(registry, "error")
    monkeypatch.setattr(runner, "execute", FailOnce(runner.execute))

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with app_client(engine) as client:
            failed = await client.post("/v1/completions", json={**BODY, "stream": stream})
            return failed, await client.post("/v1/completions", json={**BODY, "stream": stream})

    failed, ok = asyncio.run(main())
    message = "Generation failed: RuntimeError: injected runner failure"
    if stream:
        assert failed.status_code == 200
        events = sse_events(failed)
        assert events[-1] == "[DONE]" and isinstance(events[-2], dict)
        assert events[-2]["error"] == {"message": message, "type": "InternalServerError",
                                       "param": None, "code": 500}
        chunks = [e for e in sse_events(ok) if isinstance(e, dict) and e.get("choices")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert failed.status_code == 500
        assert failed.json()["error"] == {"message": message, "type": "InternalServerError",
                                          "param": None, "code": 500}
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert error_count(registry, "error") == errors_before + 1
    assert engine.check_health() == (True, "ok")
    engine.engine.check_integrity()


def test_stall_timeout_flag(monkeypatch: pytest.MonkeyPatch):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).engine_stall_timeout == 60.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--engine-stall-timeout", bad])
    seen: dict[str, object] = {}
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda **kwargs: seen.update(kwargs))
    args = parser.parse_args(["serve", "m", "--engine-stall-timeout", "2.5", "--dtype", "float32"])
    _load_engine("m", EngineConfig(), "m", args)
    assert seen["stall_timeout"] == 2.5 and seen["dtype"] == "float32"
