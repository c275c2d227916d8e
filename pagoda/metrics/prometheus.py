"""The Prometheus sink: engine stats as vLLM's metrics plus pagoda's own `pagoda:*` ones.

vLLM's names, types, labels (`model_name`, `engine`) and bucket lists are kept exactly, so
dashboards, alerts, autoscalers and gateways built for vLLM work unchanged.

Invariants:
- This is the only module that imports `prometheus_client`.
- Every finished request, including aborted ("abort") and failed ("error") ones, is counted in
  `vllm:request_success_total{finished_reason}` and observed in each per-request histogram
  whose quantity it has (vLLM counts aborts in `prompt_tokens_total` only: vllm#55634).
- `SchedulerStats.prefix_cache_*` are running totals (a snapshot); the counters grow by their
  increase between records.
- One `PrometheusStatLogger` per registry: a new one replaces the previous one's metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from pagoda.config import EngineConfig
from pagoda.metrics.base import StatLoggerBase, increase
from pagoda.stats import (
    EngineInfo,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)

DEFAULT_REGISTRY: CollectorRegistry = prometheus_client.REGISTRY
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket lists copied from vLLM's vllm/v1/metrics/loggers.py.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_DURATION_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WATERMARK_STATUSES = ("watermarked", "skipped", "not_watermarked")  # NOTE: vLLM's labels
LABEL_NAMES = ["model_name", "engine"]
# vLLM's histogram bucket families (vllm/v1/metrics/buckets.py), which --custom-histogram-buckets
# keys; request_params_n, request_num_preemptions and kv_cache_residency have no histogram here.
BUCKET_FAMILIES = ("request_latency", "time_to_first_token", "inter_token_latency", "iteration_tokens",
                   "request_params_n", "request_num_preemptions", "request_tokens", "kv_cache_residency")


def check_histogram_buckets(value: object) -> dict[str, list[float]]:
    """vLLM's --custom-histogram-buckets, parsed JSON: a family -> strictly increasing, positive,
    finite bounds; ValueError naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("custom_histogram_buckets: expected a JSON object of bucket family -> bounds")
    checked: dict[str, list[float]] = {}
    for family, bounds in value.items():
        if family not in BUCKET_FAMILIES:
            raise ValueError(f"custom_histogram_buckets: unknown bucket family {family!r}; "
                             f"known families: {sorted(BUCKET_FAMILIES)}")
        if not isinstance(bounds, list) or not bounds:
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bucket list must be a non-empty list")
        for bound in bounds:
            if isinstance(bound, bool) or not isinstance(bound, int | float):
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be a number")
            if not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be finite "
                                 "and greater than 0")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bounds {bounds} must be strictly increasing")
        checked[family] = [float(b) for b in bounds]
    return checked


MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` inclusive."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def iteration_tokens_buckets(max_num_batched_tokens: int) -> list[int]:
    """vLLM's tokens-per-step buckets, without those no step can reach.

    NOTE: a step never schedules more than `max_num_batched_tokens`, so the buckets above it
    would always equal `+Inf`; vLLM's newer vllm/v1/metrics/buckets.py caps them there too.
    """
    return [b for b in ITERATION_TOKENS_BUCKETS if b <= max_num_batched_tokens] or [1]


# NOTE: engines are rebuilt within one process (tests, a second `LLM(...)`); registering the
# same names twice in a registry raises, so the newest logger replaces the previous one's.
_OWNED: weakref.WeakKeyDictionary[CollectorRegistry, list[Collector]] = weakref.WeakKeyDictionary()


class PrometheusStatLogger(StatLoggerBase):
    """Exports engine stats under vLLM's metric names plus pagoda's own `pagoda:*` metrics.

    Args:
        model_name: the served model name, the `model_name` label of every metric.
        config: the engine config (max_model_len and the token budget size the buckets).
        engine_index: the `engine` label ("0" for a single engine).
        registry: where to register; defaults to prometheus_client's global registry.
        histogram_buckets: vLLM's --custom-histogram-buckets (`check_histogram_buckets`): a
            family's bounds replace the defaults of every histogram in it.
    """

    def __init__(self, model_name: str, config: EngineConfig, engine_index: int = 0,
                 registry: CollectorRegistry | None = None,
                 histogram_buckets: dict[str, list[float]] | None = None) -> None:
        self.registry = DEFAULT_REGISTRY if registry is None else registry
        for old in _OWNED.pop(self.registry, []):
            self.registry.unregister(old)
        self._collectors: list[Collector] = []
        _OWNED[self.registry] = self._collectors
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        self._cache_config = config.cache
        self._parallel = config.parallel
        self._num_gpu_blocks = config.cache.num_kv_blocks
        self._last_prefix_totals = (0, 0)
        custom = histogram_buckets or {}
        token_buckets = custom.get("request_tokens") or build_1_2_5_buckets(config.scheduler.max_model_len)
        ttft_buckets = custom.get("time_to_first_token") or TTFT_BUCKETS
        token_latency_buckets = custom.get("inter_token_latency") or TOKEN_LATENCY_BUCKETS
        request_latency_buckets = custom.get("request_latency") or REQUEST_LATENCY_BUCKETS
        g, c, h = self._gauge, self._counter, self._histogram

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = c("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits",
                             "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = self._register(Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABEL_NAMES, "finished_reason"], registry=None))
        for reason in FINISH_REASONS:
            self._success.labels(**self.labels, finished_reason=reason)

        self.ttft = h("vllm:time_to_first_token_seconds",
                      "Histogram of time to first token in seconds.", ttft_buckets)
        self.itl = h("vllm:inter_token_latency_seconds",
                     "Histogram of inter-token latency in seconds.", token_latency_buckets)
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.", token_latency_buckets)
        self.e2e = h("vllm:e2e_request_latency_seconds",
                     "Histogram of e2e request latency in seconds.", request_latency_buckets)
        self.queue = h("vllm:request_queue_time_seconds",
                       "Histogram of time spent in WAITING phase for request.", request_latency_buckets)
        self.prefill = h("vllm:request_prefill_time_seconds",
                         "Histogram of time spent in PREFILL phase for request.", request_latency_buckets)
        self.decode = h("vllm:request_decode_time_seconds",
                        "Histogram of time spent in DECODE phase for request.", request_latency_buckets)
        self.inference = h("vllm:request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.",
                           request_latency_buckets)
        self.req_prompt_tokens = h("vllm:request_prompt_tokens",
                                   "Number of prefill tokens processed.", token_buckets)
        self.req_generation_tokens = h("vllm:request_generation_tokens",
                                       "Number of generation tokens processed.", token_buckets)
        self.req_max_tokens = h("vllm:request_params_max_tokens",
                                "Histogram of the max_tokens request parameter.", token_buckets)
        self.req_kv_computed = h("vllm:request_prefill_kv_computed_tokens",
                                 "Histogram of new KV tokens computed during prefill "
                                 "(excluding cached tokens).", token_buckets)
        self.iteration_tokens = h(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            custom.get("iteration_tokens") or iteration_tokens_buckets(config.scheduler.max_num_batched_tokens))

        self.spec_drafts = c("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = c("vllm:spec_decode_num_draft_tokens",
                                   "Number of draft tokens.")
        self.spec_accepted = c("vllm:spec_decode_num_accepted_tokens",
                               "Number of accepted tokens.")
        self._spec_per_pos = self._register(Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", [*LABEL_NAMES, "position"], registry=None))

        self.blocks_total = g("pagoda:kv_blocks", "KV blocks in the pool.")
        self.blocks_free = g("pagoda:kv_blocks_free", "KV blocks not held by any running request.")
        self.blocks_cached = g("pagoda:kv_blocks_cached",
                               "KV blocks holding a reusable prefix (hashed, full).")
        self.tokens_held = g("pagoda:kv_tokens_held", "Tokens whose KV the running requests hold.")
        self.slots_reserved = g("pagoda:kv_slots_reserved",
                                "Token slots in the blocks the running requests hold.")
        self.step_duration = h("pagoda:engine_step_duration_seconds",
                               "Wall time of one engine step in seconds.", STEP_DURATION_BUCKETS)
        self._failures = self._register(Counter(
            "pagoda:request_failures", "Requests that failed in the engine, by reason.",
            [*LABEL_NAMES, "reason"], registry=None))
        self._rejections = self._register(Counter(
            "pagoda:requests_rejected", "Requests refused before reaching the engine, by reason "
            "(queue_full: --max-queued-requests).", [*LABEL_NAMES, "reason"], registry=None))
        self._rejections.labels(**self.labels, reason="queue_full")
        self._watermarks: Counter | None = None
        if config.watermark is not None:
            self._watermarks = self._register(Counter(
                "vllm:watermark_requests", "Finished requests by watermark status "
                "(only with watermark_config).", [*LABEL_NAMES, "status"], registry=None))
            for status in WATERMARK_STATUSES:
                self._watermarks.labels(**self.labels, status=status)
        self._cache_info = self._register(Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            sorted([*self._cache_info_labels(), "engine"]), registry=None))
        self._set_cache_info()
        self._engine_info = self._register(Gauge(
            "pagoda:kernel_plan_info", "The CPU kernel build, the linear kernels chosen by "
            "measurement for the model's largest bf16 weight (kernel_plan.py), and how decode steps "
            "run the decoder layers (the native stack, or layer by layer and why).",
            [*LABEL_NAMES, "kernel_variant", "linear_kernels", "kernel_plan_source", "decoder"], registry=None))

    def record_engine_info(self, info: EngineInfo) -> None:
        self._engine_info.clear()
        self._engine_info.labels(**self.labels, kernel_variant=info.kernel_variant,
                                 linear_kernels=info.linear_kernels,
                                 kernel_plan_source=info.kernel_plan_source, decoder=info.decoder).set(1)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def log(self) -> None:
        """Nothing to do: Prometheus pulls."""

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        last_queries, last_hits = self._last_prefix_totals
        self.prefix_queries.inc(increase(stats.prefix_cache_queries, last_queries))
        self.prefix_hits.inc(increase(stats.prefix_cache_hits, last_hits))
        self._last_prefix_totals = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        self.blocks_total.set(stats.num_blocks_total)
        self.blocks_free.set(stats.num_blocks_free)
        self.blocks_cached.set(stats.num_blocks_cached)
        self.tokens_held.set(stats.num_tokens_held)
        self.slots_reserved.set(stats.num_slots_reserved)
        if stats.num_blocks_total and stats.num_blocks_total != self._num_gpu_blocks:
            self._num_gpu_blocks = stats.num_blocks_total
            self._set_cache_info()

    def _record_iteration(self, stats: IterationStats) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        # NOTE: vLLM observes prompt + generation tokens, which books a chunked prompt (cached
        # prefix included) in the step that finishes it; the scheduled count is what each step
        # computed. A step that computed nothing (the engine idling) is not an iteration.
        num_tokens = stats.num_scheduled_tokens or (
            stats.num_prompt_tokens + stats.num_generation_tokens)
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)
        if stats.step_duration > 0:
            self.step_duration.observe(stats.step_duration)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for reason, count in stats.failed_requests.items():
            self._failures.labels(**self.labels, reason=reason).inc(count)
        for reason, count in stats.rejected_requests.items():
            self._rejections.labels(**self.labels, reason=reason).inc(count)
        if stats.spec_decoding is not None:
            self._record_spec(stats.spec_decoding)
        for finished in stats.finished_requests:
            self._record_finished(finished)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            self._spec_per_pos.labels(**self.labels, position=str(position)).inc(count)

    def _record_finished(self, req: FinishedRequestStats) -> None:
        self._success.labels(**self.labels, finished_reason=req.finish_reason).inc()
        if self._watermarks is not None and req.watermark_status is not None:
            self._watermarks.labels(**self.labels, status=req.watermark_status).inc()
        self.e2e.observe(req.e2e_latency)
        self.queue.observe(req.queue_time)
        self.req_prompt_tokens.observe(req.num_prompt_tokens)
        self.req_generation_tokens.observe(req.num_generation_tokens)
        if req.max_tokens_param:
            self.req_max_tokens.observe(req.max_tokens_param)
        # NOTE: a request aborted or failed while still queued never ran: observing zeros in
        # the running-phase histograms would pass for very fast requests.
        ran = req.num_generation_tokens > 0 or req.prefill_time > 0 or req.inference_time > 0
        if ran:
            self.req_kv_computed.observe(max(req.num_prompt_tokens - req.num_cached_tokens, 0))
            self.prefill.observe(req.prefill_time)
            self.decode.observe(req.decode_time)
            self.inference.observe(req.inference_time)
        # NOTE: time per output token is undefined below two tokens (there is no interval).
        if req.num_generation_tokens > 1:
            self.tpot.observe(req.mean_time_per_output_token)

    def _cache_info_labels(self) -> dict[str, str]:
        info = {k: str(v) for k, v in dataclasses.asdict(self._cache_config).items()}
        info["num_gpu_blocks"] = str(self._num_gpu_blocks)
        # NOTE: the parallel layout too, so a dashboard sees that each rank's pool holds a
        # share of the heads (and layers) of every block.
        info["tensor_parallel_size"] = str(self._parallel.tensor_parallel_size)
        info["pipeline_parallel_size"] = str(self._parallel.pipeline_parallel_size)
        return info

    def _set_cache_info(self) -> None:
        self._cache_info.clear()
        self._cache_info.labels(**self._cache_info_labels(), engine=self.labels["engine"]).set(1)

    def _register(self, metric: MetricT) -> MetricT:
        self.registry.register(metric)
        self._collectors.append(metric)
        return metric

    def _gauge(self, name: str, doc: str) -> Gauge:
        metric = self._register(Gauge(name, doc, LABEL_NAMES, registry=None))
        return metric.labels(**self.labels)

    def _counter(self, name: str, doc: str) -> Counter:
        metric = self._register(Counter(name, doc, LABEL_NAMES, registry=None))
        return metric.labels(**self.labels)

    def _histogram(self, name: str, doc: str, buckets: list[int] | list[float]) -> Histogram:
        metric = self._register(Histogram(name, doc, LABEL_NAMES, buckets=buckets, registry=None))
        return metric.labels(**self.labels)


def render_metrics(registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The body and Content-Type of a `GET /metrics` answer (Prometheus text format 0.0.4)."""
    body = prometheus_client.generate_latest(DEFAULT_REGISTRY if registry is None else registry)
    return body, CONTENT_TYPE
