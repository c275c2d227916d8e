"""`pagoda bench serve`: an async load generator for any OpenAI-compatible server.

Requests leave on a schedule (Poisson arrivals at --request-rate, or all at once), at most
--max-concurrency in flight. The run starts with one test request (retried until the server
answers or --ready-check-timeout-sec passes), then --num-warmups warm-up requests, then the
measured run. Every request is accounted for: failures are counted, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pagoda.bench.datasets import SampleRequest
from pagoda.bench.endpoints import RequestFuncInput, RequestFuncOutput, request_stream
from pagoda.bench.report import calculate_metrics, format_result_block


@dataclass(frozen=True)
class LoadSettings:
    """How the load is applied.

    Attributes:
        api_url: the full endpoint URL, e.g. http://127.0.0.1:8000/v1/completions.
        model: the model name sent in each request.
        chat: send chat messages (True) or a plain prompt (False).
        request_rate: mean arrivals per second (Poisson); inf sends everything at once.
        burstiness: gamma shape of the gaps; 1.0 is Poisson.
        max_concurrency: most requests in flight; None for no limit.
        ignore_eos: ask the server to generate exactly max_tokens.
        num_warmups: warm-up requests (the first prompt) before the measured run.
        ready_check_timeout_s: how long the test request is retried; 0 skips it.
        seed: fixes the arrival times.
        extra_body: merged into every request body (sampling parameters).
        headers: sent with every request.
        disable_tqdm: no progress bar.
    """

    api_url: str
    model: str
    chat: bool = False
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    num_warmups: int = 0
    ready_check_timeout_s: float = 600.0
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    disable_tqdm: bool = False


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of `num` requests; all zero for an infinite rate.

    Gaps are gamma(burstiness, 1 / (rate * burstiness)), exponential when burstiness is 1,
    then rescaled (like vLLM) so that the last request leaves at num / rate.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be positive, got "
                         f"{request_rate} and {burstiness}.")
    if math.isinf(request_rate) or num == 0:
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    times *= (num / request_rate) / times[-1]
    return [float(t) for t in times]


def _request_input(settings: LoadSettings, req: SampleRequest) -> RequestFuncInput:
    return RequestFuncInput(api_url=settings.api_url, model=settings.model, prompt=req.prompt,
                            prompt_len=req.prompt_len, output_len=req.expected_output_len,
                            chat=settings.chat, ignore_eos=settings.ignore_eos,
                            extra_body=dict(settings.extra_body))


def make_client(max_concurrency: int | None, timeout_s: float = 6 * 3600) -> httpx.AsyncClient:
    """One pooled client; the pool never holds back a request the semaphore lets through."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


async def _schedule(requests: list[SampleRequest], offsets: list[float]
                    ) -> AsyncIterator[SampleRequest]:
    start = time.perf_counter()
    for req, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield req


async def ready_check(client: httpx.AsyncClient, settings: LoadSettings,
                      req: SampleRequest) -> RequestFuncOutput:
    """Sends the first request until it succeeds, the server rejects it, or time runs out.

    Only "not there yet" is retried: no connection, or 503 (loading or draining).
    """
    deadline = time.monotonic() + settings.ready_check_timeout_s
    while True:
        out = await request_stream(client, _request_input(settings, req), settings.headers)
        retry = out.status_code is None or out.status_code == 503
        if out.success or not retry or time.monotonic() >= deadline:
            return out
        await asyncio.sleep(1.0)


async def _warm_up(client: httpx.AsyncClient, settings: LoadSettings,
                   req: SampleRequest) -> None:
    limit = asyncio.Semaphore(settings.max_concurrency or settings.num_warmups)

    async def one() -> None:
        async with limit:
            await request_stream(client, _request_input(settings, req), settings.headers)

    await asyncio.gather(*(one() for _ in range(settings.num_warmups)))


async def _run_load(client: httpx.AsyncClient, settings: LoadSettings,
                    requests: list[SampleRequest]) -> tuple[list[RequestFuncOutput], float]:
    offsets = arrival_offsets(len(requests), settings.request_rate, settings.burstiness,
                              settings.seed)
    pbar = tqdm(total=len(requests), disable=settings.disable_tqdm)
    limit: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency
        else contextlib.nullcontext())

    async def one(req: SampleRequest) -> RequestFuncOutput:
        async with limit:
            out = await request_stream(client, _request_input(settings, req), settings.headers)
        pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(req)) async for req in _schedule(requests, offsets)]
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    pbar.close()
    return outputs, duration


async def run_benchmark(settings: LoadSettings, requests: list[SampleRequest],
                        client: httpx.AsyncClient | None = None
                        ) -> tuple[list[RequestFuncOutput], float]:
    """Checks the endpoint, warms up, then runs the measured load.

    Returns the outputs in request order and the wall time of the measured run (s).

    Raises:
        RuntimeError: when the test request never succeeds.
    """
    if not requests:
        raise ValueError("no requests to send.")
    owned = client is None
    client = client or make_client(settings.max_concurrency)
    try:
        if settings.ready_check_timeout_s > 0:
            print("Starting initial single prompt test run...")
            test = await ready_check(client, settings, requests[0])
            if not test.success:
                raise RuntimeError("Initial test run failed - Please make sure benchmark "
                                   f"arguments are correctly specified. Error: {test.error}")
            print("Initial test run completed.")
        if settings.num_warmups > 0:
            print(f"Warming up with {settings.num_warmups} requests...")
            await _warm_up(client, settings, requests[0])
            print("Warmup run completed.")
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {settings.request_rate}")
        kind = "Poisson process" if settings.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {settings.burstiness} ({kind})")
        print(f"Maximum request concurrency: {settings.max_concurrency}")
        return await _run_load(client, settings, requests)
    finally:
        if owned:
            await client.aclose()


def benchmark_result(settings: LoadSettings, outputs: list[RequestFuncOutput], duration: float,
                     percentiles: list[float], count_tokens: Any = None,
                     goodput_slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's result dict plus the run's settings (date, endpoint, rate, concurrency, ...)."""
    failures = [o.error for o in outputs if not o.success]
    if failures:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, error in enumerate(failures[:10]):
            print(f"Error {i}: {error}")
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if settings.chat else "openai",
        "endpoint_type": "openai-chat" if settings.chat else "openai",
        "api_url": settings.api_url,
        "model_id": settings.model,
        "num_prompts": len(outputs),
        "request_rate": settings.request_rate if settings.request_rate != float("inf") else "inf",
        "burstiness": settings.burstiness,
        "max_concurrency": settings.max_concurrency,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }
    result.update(calculate_metrics(outputs, duration, percentiles, count_tokens, goodput_slos_ms))
    return result


def print_result(result: dict[str, Any], settings: LoadSettings, metrics: list[str],
                 percentiles: list[float]) -> None:
    print(format_result_block(result, settings.max_concurrency, settings.request_rate,
                              metrics, percentiles))


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    """Writes the result JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return path


def default_result_filename(label: str, settings: LoadSettings, date: str) -> str:
    """vLLM's name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    concurrency = (f"-concurrency{settings.max_concurrency}"
                   if settings.max_concurrency is not None else "")
    model = settings.model.rstrip("/").split("/")[-1]
    return f"{label}-{settings.request_rate}qps{concurrency}-{model}-{date}.json"
