"""Metric values after a known workload, run through a real LLMEngine on the tiny model.

The engine has a small pool (12 blocks of 16 tokens) and a `PrometheusStatLogger` on its own
registry. The workload: two requests sharing a 2-block prefix (one prefix hit), one that
finishes by length, one by a stop token id, one aborted mid-decode, and four that together
outgrow the pool (preemptions). Expected values come from the requests' outputs and the
prompts, never from the metrics themselves.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pagoda.config import EngineConfig
from pagoda.engine import LLMEngine
from pagoda.metrics import PrometheusStatLogger
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

ENGINE_ARGS: dict = {"dtype": "float32", "num_kv_blocks": 12, "max_model_len": 128,
                     "block_size": 16, "enable_prefix_caching": True}
LABELS = {"model_name": "tiny", "engine": "0"}
SHARED_PREFIX_LEN = 32  # two full blocks


class Workload:
    """Drives an engine with add_request/step/abort_request and tallies what came out."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rng = random.Random(0)
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def prompt(self, length: int) -> list[int]:
        # NOTE: ids far from the special tokens, so no prompt ends a request early.
        return [self.rng.randrange(1000, 40000) for _ in range(length)]

    def add(self, request_id: str, prompt: list[int], **params: object) -> None:
        params = {"temperature": 0.0, "ignore_eos": True, **params}
        self.engine.add_request(request_id, prompt, SamplingParams(**params))  # type: ignore[arg-type]
        self.prompts[request_id] = prompt
        self.tokens[request_id] = []

    def absorb(self, out: RequestOutput | None) -> None:
        if out is None:
            return
        for delta in out.outputs:
            self.tokens[out.request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish_reasons[out.request_id] = delta.finish_reason

    def step(self) -> None:
        for out in self.engine.step():
            self.absorb(out)

    def run(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def abort(self, request_id: str) -> None:
        self.absorb(self.engine.abort_request(request_id))


@pytest.fixture(scope="module")
def workload(tiny_llama: Path) -> Iterator[tuple[Workload, CollectorRegistry]]:
    registry = CollectorRegistry()
    config = EngineConfig.from_kwargs(str(tiny_llama), **ENGINE_ARGS).with_max_model_len(128)
    logger = PrometheusStatLogger("tiny", config, registry=registry)
    engine = LLMEngine.from_engine_args(str(tiny_llama), stat_loggers=[logger], **ENGINE_ARGS)
    w = Workload(engine)

    shared = w.prompt(SHARED_PREFIX_LEN)
    w.add("prefix-a", shared + w.prompt(5), max_tokens=3)
    w.run()
    w.add("prefix-b", shared + w.prompt(7), max_tokens=3)
    w.run()

    short = w.prompt(10)
    w.add("length", short, max_tokens=6)
    w.run()
    stop_token = w.tokens["length"][2]
    w.add("stop", short, max_tokens=6, stop_token_ids=[stop_token])
    w.add("abort", w.prompt(12), max_tokens=50)
    while len(w.tokens["abort"]) < 3:
        w.step()
    w.abort("abort")
    w.run()

    for i in range(4):  # NOTE: 4 x 60 tokens need 16 blocks; the pool has 12.
        w.add(f"preempt-{i}", w.prompt(10), max_tokens=50)
    w.run()
    yield w, registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_finish_reasons(workload: tuple[Workload, CollectorRegistry]):
    w, registry = workload
    reasons = Counter(w.finish_reasons.values())
    assert reasons == {"length": 7, "stop": 1, "abort": 1}
    assert w.finish_reasons["stop"] == "stop" and w.finish_reasons["abort"] == "abort"
    assert w.tokens["stop"][-1] == w.tokens["length"][2]
    for reason in ("stop", "length", "abort", "error"):
        assert value(registry, "vllm:request_success_total",
                     finished_reason=reason) == reasons.get(reason, 0), reason


def test_token_totals(workload: tuple[Workload, CollectorRegistry]):
    w, registry = workload
    num_prompt = sum(len(p) for p in w.prompts.values())
    num_generated = sum(len(t) for t in w.tokens.values())
    assert 3 <= len(w.tokens["abort"]) < 50
    assert all(len(w.tokens[f"preempt-{i}"]) == 50 for i in range(4))
    assert value(registry, "vllm:prompt_tokens_total") == num_prompt
    assert value(registry, "vllm:generation_tokens_total") == num_generated
    assert value(registry, "vllm:request_prompt_tokens_sum") == num_prompt
    assert value(registry, "vllm:request_generation_tokens_sum") == num_generated
    assert value(registry, "vllm:request_generation_tokens_count") == len(w.prompts)
    assert value(registry, "vllm:e2e_request_latency_seconds_count") == len(w.prompts)
    max_tokens = 3 + 3 + 6 + 6 + 50 + 4 * 50
    assert value(registry, "vllm:request_params_max_tokens_sum") == max_tokens


def test_preemptions_forced_by_the_small_pool(workload: tuple[Workload, CollectorRegistry]):
    w, registry = workload
    preemptions = value(registry, "vllm:num_preemptions_total")
    assert preemptions is not None and preemptions > 0
    assert preemptions == w.engine.scheduler.num_preemptions


def test_prefix_cache_hit(workload: tuple[Workload, CollectorRegistry]):
    w, registry = workload
    assert value(registry, "vllm:prefix_cache_hits_total") == SHARED_PREFIX_LEN
    assert value(registry, "vllm:prefix_cache_queries_total") == sum(
        len(p) for p in w.prompts.values())
    histogram = "vllm:request_prefill_kv_computed_tokens_sum"
    assert value(registry, histogram) == sum(len(p) for p in w.prompts.values()) - SHARED_PREFIX_LEN


def test_pool_gauges_after_the_workload(workload: tuple[Workload, CollectorRegistry]):
    w, registry = workload
    assert value(registry, "pagoda:kv_blocks") == 12
    assert value(registry, "pagoda:kv_blocks_free") == 12
    assert value(registry, "pagoda:kv_tokens_held") == 0
    assert value(registry, "pagoda:kv_slots_reserved") == 0
    assert value(registry, "vllm:num_requests_running") == 0
    assert value(registry, "vllm:num_requests_waiting") == 0
    assert value(registry, "vllm:kv_cache_usage_perc") == 0
    w.engine.check_integrity()
