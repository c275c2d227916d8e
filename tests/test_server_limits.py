"""Hostile and careless requests against the served app: each gets a clear 4xx, and the
innocent requests running beside it get exactly their output (issue: reliability).

In-process: the FastAPI app over a real AsyncLLM serving the tiny random Llama, through
httpx's ASGI transport. The last tests run the real `pagoda serve` loop (uvicorn on a port)
to check that a dead engine ends the process with status 1 and ends every open stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import test_health as health
from prometheus_client import CollectorRegistry

from pagoda.async_engine import AsyncLLM, EngineDeadError
from pagoda.config import EngineConfig
from pagoda.sampling_params import SamplingParams
from pagoda.server import serve

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128,
                     "max_prompt_chars": 2000, "max_n": 64}
INNOCENT = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            for p in ("The quick brown fox", "Once upon a time", "In the beginning")]


def make_engine(model: Path, registry: CollectorRegistry | None = None,
                **overrides: object) -> AsyncLLM:
    return health.make_engine(model, registry, **{**ENGINE_ARGS, **overrides})


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, registry: CollectorRegistry) -> Iterator[AsyncLLM]:
    eng = make_engine(tiny_llama, registry)
    yield eng
    eng.shutdown()


app_client = health.app_client


def texts(responses: list[httpx.Response]) -> list[str]:
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in responses]


@pytest.fixture(scope="module")
def alone(engine: AsyncLLM) -> list[str]:
    """Each innocent request's text when it runs alone."""
    async def main() -> list[httpx.Response]:
        async with app_client(engine) as client:
            return [await client.post("/v1/completions", json=body) for body in INNOCENT]

    return texts(asyncio.run(main()))


def beside_innocents(engine: AsyncLLM, method: str, path: str, **kwargs: object
                     ) -> tuple[httpx.Response, list[httpx.Response]]:
    """Sends the hostile request while the innocents run; returns both answers."""
    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with app_client(engine) as client:
            runs = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in INNOCENT]
            await asyncio.sleep(0.01)
            hostile = await client.request(method, path, **kwargs)  # type: ignore[arg-type]
            return hostile, list(await asyncio.gather(*runs))

    return asyncio.run(main())


def as_json(body: object) -> dict:
    """Request kwargs sending `body` as ASCII JSON (so lone surrogates travel escaped, as a
    hostile client sends them; httpx's own `json=` refuses to encode them)."""
    return {"content": json.dumps(body), "headers": {"Content-Type": "application/json"}}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status
    return error


@pytest.mark.parametrize("body, param, words", [
    ({"n": 9223372036854775808, "temperature": 1}, "n", "n must be at most 64"),
    ({"n": 1_000_000, "temperature": 1}, "n", "--max-n"),
    ({"max_tokens": 16, "min_tokens": 1, "stop_token_ids": [999999999]}, "stop_token_ids",
     "out of vocabulary"),
    ({"seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
    ({"top_k": 1e30}, "top_k", "top_k: Unable to parse input string as an integer"),
    ({"prompt": "hi\ud800"}, None, "not valid Unicode"),
    ({"prompt": "x" * 2001}, "prompt", "--max-prompt-chars"),
    ({"prompt": [[5, 6]] * 2000}, "n", "--max-queued-requests"),
    ({"priority": 3}, "priority", "priority scheduling is not enabled (--scheduling-policy priority)"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1 or positive"),
])
def test_hostile_completion_gets_a_400_and_innocents_their_output(
        engine: AsyncLLM, alone: list[str], body: dict, param: str | None, words: str):
    full = {"prompt": "Once upon a time", **body}
    hostile, innocents = beside_innocents(engine, "POST", "/v1/completions", **as_json(full))
    error = error_of(hostile, 400)
    assert words in error["message"] and error["param"] == param
    assert "Traceback" not in error["message"] and "Overflow" not in error["message"]
    assert texts(innocents) == alone


def test_the_requests_of_one_user_share_a_scheduling_group(engine: AsyncLLM,
                                                           monkeypatch: pytest.MonkeyPatch):
    """Issue 23: one client's many requests must not starve others; requests naming the same
    OpenAI `user` take turns as one group (without it, each request is its own group)."""
    groups: list[str | None] = []
    process = engine.processor.process

    def recording(*args: object, **kwargs: object):  # noqa: ANN202
        groups.append(kwargs.get("group"))  # type: ignore[arg-type]
        return process(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.processor, "process", recording)

    async def main() -> list[httpx.Response]:
        async with app_client(engine) as client:
            bodies = [{"prompt": "hi", "max_tokens": 2, "user": "alice"},
                      {"prompt": ["a", "b"], "max_tokens": 2, "user": "alice"},
                      {"prompt": ["a", "b"], "max_tokens": 2}]
            return [await client.post("/v1/completions", json=body) for body in bodies]

    texts(asyncio.run(main()))
    assert groups[:3] == ["user:alice"] * 3
    assert groups[3] == groups[4] and groups[3].startswith("cmpl-")  # type: ignore[union-attr]


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine: AsyncLLM):
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the context length),
    or with `truncation_side` "right" its first k."""
    ids = list(range(100, 140))

    async def main() -> list[httpx.Response]:
        async with app_client(engine) as client:
            bodies = [{"prompt": ids, "max_tokens": 2, "temperature": 0, "truncate_prompt_tokens": k}
                      for k in (5, -1, None)] + [{"prompt": ids[-5:], "max_tokens": 2, "temperature": 0}]
            bodies += [{"prompt": ids, "max_tokens": 2, "temperature": 0, "truncate_prompt_tokens": 5,
                        "truncation_side": "right"}, {"prompt": ids[:5], "max_tokens": 2, "temperature": 0},
                       {"prompt": ids, "truncation_side": "middle"}]
            return [await client.post("/v1/completions", json=body) for body in bodies]

    five, whole, plain, last_five, right, first_five, bad = asyncio.run(main())
    assert [r.json()["usage"]["prompt_tokens"] for r in (five, whole, plain)] == [5, 40, 40]
    assert texts([five]) == texts([last_five]) and texts([right]) == texts([first_five])
    assert bad.status_code == 400


def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_server_lives(tiny_llama: Path):
    """3,000 chained Lark rules segfaulted the whole server (issue 23). With the rule limit
    raised so it reaches the library, it crashes one sandbox process: the request gets a 400,
    the innocents beside it their output, and the next grammar compiles."""
    engine = make_engine(tiny_llama, max_grammar_rules=10**6, max_grammar_bytes=10**7)
    try:
        alone_texts = texts(asyncio.run(_post_all(engine, INNOCENT)))
        grammar = "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(3000)) + 'r3000: "b"\n'
        hostile, innocents = beside_innocents(engine, "POST", "/v1/completions", **as_json(
            {"prompt": "hi", "max_tokens": 4, "guided_grammar": grammar}))
        error = error_of(hostile, 400)
        assert "the grammar compiler failed" in error["message"], error
        assert texts(innocents) == alone_texts
        ok, _ = beside_innocents(engine, "POST", "/v1/completions", **as_json(
            {"prompt": "hi", "max_tokens": 4, "guided_choice": ["yes", "no"]}))
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")
    finally:
        engine.shutdown()


def test_slow_grammar_compiles_leave_plain_requests_and_tokenize_free(engine: AsyncLLM,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """Issue 23, finding 2: eight requests with big choice lists held the threads tokenizing
    needs, and plain completions and /tokenize waited 17-60 s. Eight compiles that do not end
    until released: a plain completion and /tokenize answer while all eight still wait."""
    compiler = engine.processor.grammars
    build, release, started = compiler._build, threading.Event(), threading.Semaphore(0)

    def slow_build(*args: object) -> object:
        started.release()
        release.wait(60)
        return build(*args)

    monkeypatch.setattr(compiler, "_build", slow_build)

    async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response, bool]:
        async with app_client(engine) as client:
            choices = [[f"slow{i}-a", f"slow{i}-b"] for i in range(8)]
            slow = [asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "guided_choice": c})) for c in choices]
            while not started.acquire(blocking=False):  # NOTE: a compile has begun
                await asyncio.sleep(0.01)
            plain = await client.post("/v1/completions", json=INNOCENT[0])
            tokens = await client.post("/tokenize", json={"prompt": "The quick brown fox"})
            still_waiting = not any(task.done() for task in slow)
            release.set()
            return list(await asyncio.gather(*slow)), plain, tokens, still_waiting

    slow, plain, tokens, still_waiting = asyncio.run(main())
    assert still_waiting, "a compile ended before it was released"
    assert plain.status_code == 200 and tokens.status_code == 200, (plain.text, tokens.text)
    assert tokens.json()["count"] > 0
    for r in slow:
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("slow"), r.text


async def _post_all(engine: AsyncLLM, bodies: list[dict]) -> list[httpx.Response]:
    async with app_client(engine) as client:
        return [await client.post("/v1/completions", json=body) for body in bodies]


@pytest.mark.parametrize("body", [{"top_k": 9223372036854775808}, {"top_k": 10**30},
                                  {"temperature": 5e-324}])
def test_extreme_but_valid_values_run(engine: AsyncLLM, alone: list[str], body: dict):
    full = {"prompt": INNOCENT[1]["prompt"], "max_tokens": 12, "ignore_eos": True, **body}
    hostile, innocents = beside_innocents(engine, "POST", "/v1/completions", json=full)
    assert texts(innocents) == alone
    [text] = texts([hostile])
    if "temperature" in body:  # below 1e-5 is greedy, as vLLM
        assert text == alone[1]


def test_lone_surrogates_anywhere_are_400(engine: AsyncLLM):
    async def main() -> list[httpx.Response]:
        async with app_client(engine) as client:
            return [
                await client.post("/v1/chat/completions", **as_json(
                    {"messages": [{"role": "user", "content": "a\udfff"}]})),
                await client.post("/v1/completions", **as_json({"prompt": "ok", "stop": ["\ud800"]})),
                await client.post("/v1/completions", **as_json({"prompt": "ok", "model": "\ud800"})),
                await client.post("/tokenize", **as_json({"prompt": "\ud800"})),
            ]

    for r in asyncio.run(main()):
        assert "not valid Unicode" in error_of(r, 400)["message"]


def test_long_prompts_are_refused_before_tokenizing(engine: AsyncLLM,
                                                    monkeypatch: pytest.MonkeyPatch):
    calls: list[int] = []
    tokenizer = engine.tokenizer
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(len(text))
                        or encode(text, **kw))

    async def main() -> list[httpx.Response]:
        long = "word " * 1000
        async with app_client(engine) as client:
            return [
                await client.post("/v1/completions", json={"prompt": long}),
                await client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": long}]}),
                await client.post("/tokenize", json={"prompt": long}),
                await client.post("/detokenize", json={"tokens": [5] * 2001}),
            ]

    for r in asyncio.run(main()):
        assert "--max-prompt-chars" in error_of(r, 400)["message"]
    assert calls == []


def test_bodies_over_the_limit_are_413(engine: AsyncLLM):
    big = json.dumps({"prompt": "a" * 5000}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async def main() -> list[httpx.Response]:
        async with app_client(engine, max_request_body_bytes=4096) as client:
            headers = {"Content-Type": "application/json"}
            return [await client.post("/v1/completions", content=big, headers=headers),
                    await client.post("/v1/completions", content=chunks(), headers=headers),
                    await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})]

    sized, chunked, small = asyncio.run(main())
    for r in (sized, chunked):
        assert "--max-request-body-bytes" in error_of(r, 413)["message"]
    assert small.status_code == 200


def test_a_queue_count_never_counts_a_sequence_twice(tiny_llama: Path):
    """The queue's count was the engine's waiting requests plus the adds in the command deque,
    read one after the other: a request read in the deque, then drained and counted as waiting
    before the second read, counted twice, and a 1,000-prompt request on an idle server was
    refused as "1,240 sequences are waiting". Here another thread reads the count while
    requests of 64 prompts (the queue's limit) are sent one after another, thread switches made
    as frequent as they go: never more than 64, and every request is admitted."""
    import sys

    engine = make_engine(tiny_llama, max_num_seqs=8, max_queued_requests=64)
    body = {"prompt": [f"item {i}" for i in range(64)], "max_tokens": 2, "temperature": 0}
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(engine.num_queued_sequences())

    async def main() -> list[int]:
        async with app_client(engine) as client:
            return [(await client.post("/v1/completions", json=body)).status_code for _ in range(4)]

    interval = sys.getswitchinterval()
    watcher = threading.Thread(target=watch)
    sys.setswitchinterval(1e-6)
    watcher.start()
    try:
        codes = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
        sys.setswitchinterval(interval)
        engine.shutdown()
    assert codes == [200] * 4
    assert seen and max(seen) <= 64


def test_a_full_queue_answers_429_and_counts_it(tiny_llama: Path):
    registry = CollectorRegistry()
    engine = make_engine(tiny_llama, registry, max_num_seqs=1, max_queued_requests=2)
    step = engine.engine.step

    def slow_step() -> list:
        time.sleep(0.01)  # NOTE: the tiny model is so fast the queue would never fill
        return step()

    engine.engine.step = slow_step  # type: ignore[method-assign]
    long = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0}

    async def main() -> tuple[httpx.Response, httpx.Response, list[httpx.Response]]:
        async with app_client(engine) as client:
            async def until(condition: Callable[[], bool]) -> None:
                deadline = time.monotonic() + 30
                while not condition() and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                assert condition()

            runs = [asyncio.create_task(client.post("/v1/completions", json=long))]
            await until(lambda: engine.num_unfinished_requests() == 1
                        and engine.num_queued_sequences() == 0)  # one running
            runs += [asyncio.create_task(client.post("/v1/completions", json=long))
                     for _ in range(2)]
            await until(lambda: engine.num_queued_sequences() == 2)  # two waiting
            full = await client.post("/v1/completions", json={**long, "max_tokens": 2})
            too_many = await client.post("/v1/completions", json={**long, "n": 3,
                                                                   "temperature": 1})
            return full, too_many, list(await asyncio.gather(*runs))

    try:
        full, too_many, runs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert "--max-queued-requests 2" in error_of(full, 429)["message"]
    assert 1 <= int(full.headers["Retry-After"]) <= 60
    assert error_of(too_many, 400)["param"] == "n"
    assert [r.status_code for r in runs] == [200, 200, 200]
    rejected = registry.get_sample_value("pagoda:requests_rejected_total",
                                         {"model_name": "tiny", "engine": "0",
                                          "reason": "queue_full"})
    assert rejected == 1


def test_shutdown_ends_open_streams(tiny_llama: Path):
    engine = make_engine(tiny_llama)

    async def main() -> BaseException | None:
        params = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0)
        stream = engine.generate([5, 6, 7], params, "r")
        await stream.__anext__()
        threading.Timer(0.05, engine.shutdown).start()
        try:
            async for _ in stream:
                pass
        except EngineDeadError as e:
            return e
        return None

    error = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(error, EngineDeadError) and "shut down" in str(error)


def test_a_dead_engine_ends_streams_and_exits_1(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    engine = make_engine(tiny_llama)
    step = engine.engine.step
    calls = 0

    def dying_step() -> list:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("scheduler invariant broken")
        return step()

    monkeypatch.setattr(engine.engine, "step", dying_step)
    monkeypatch.setattr(serve, "_load_engine", lambda *a: engine)
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    port = serve_port()
    args = parser.parse_args(["tiny", "--port", str(port), "--uvicorn-log-level", "warning"])
    events: list[str] = []

    def client() -> None:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        body = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=client)
    thread.start()
    code = asyncio.run(asyncio.wait_for(serve._serve(args, "tiny", EngineConfig()), 60))
    thread.join(30)
    assert code == 1
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "scheduler invariant broken" in error["message"]


def serve_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
