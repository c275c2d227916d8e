"""Stat loggers: exact exported values for known stats, vLLM's names/buckets, the log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from pagoda.config import EngineConfig, SchedulerConfig
from pagoda.metrics import (
    LoggingStatLogger,
    PrometheusStatLogger,
    check_histogram_buckets,
    default_stat_loggers,
    format_kv_memory_report,
    render_metrics,
)
from pagoda.stats import FinishedRequestStats, IterationStats, SchedulerStats

MODEL = "tiny-model"
LABELS = {"model_name": MODEL, "engine": "0"}

# Copied from vLLM's vllm/v1/metrics/loggers.py.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS_1_2_5_TO_2048 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
ITERATION_TO_2048 = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]

EXPORTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "pagoda:kv_blocks": "gauge",
    "pagoda:kv_blocks_free": "gauge",
    "pagoda:kv_blocks_cached": "gauge",
    "pagoda:kv_tokens_held": "gauge",
    "pagoda:kv_slots_reserved": "gauge",
    "pagoda:request_failures_total": "counter",
    "pagoda:requests_rejected_total": "counter",
    "pagoda:kernel_plan_info": "gauge",
    "vllm:spec_decode_num_drafts_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "pagoda:engine_step_duration_seconds": "histogram",
}


def finished(reason: str, **kw: float | int | None) -> FinishedRequestStats:
    base: dict = dict(finish_reason=reason, num_prompt_tokens=10, num_generation_tokens=4,
                      max_tokens_param=16, e2e_latency=2.0, queue_time=0.4, prefill_time=0.6,
                      decode_time=1.0, inference_time=1.6, mean_time_per_output_token=0.25,
                      num_cached_tokens=0)
    return FinishedRequestStats(**{**base, **kw})


def make_logger(**scheduler: int) -> tuple[PrometheusStatLogger, CollectorRegistry]:
    registry = CollectorRegistry()
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler)) if scheduler else EngineConfig()
    return PrometheusStatLogger(MODEL, config, registry=registry), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def buckets(registry: CollectorRegistry, name: str) -> list[float]:
    bounds = [s.labels["le"] for m in registry.collect() if m.name == name
              for s in m.samples if s.name == f"{name}_bucket"]
    assert bounds[-1] == "+Inf"
    return [float(b) for b in bounds[:-1]]


def test_exports_exactly_vllm_names_and_types() -> None:
    _, registry = make_logger()
    text = render_metrics(registry)[0].decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    exported = {name: kind for name, kind in types.items() if not name.endswith("_created")}
    assert exported == EXPORTED_TYPES


def test_histogram_buckets_equal_vllm_lists() -> None:
    _, registry = make_logger(max_model_len=2048, max_num_batched_tokens=2048)
    assert buckets(registry, "vllm:time_to_first_token_seconds") == VLLM_TTFT
    assert buckets(registry, "vllm:inter_token_latency_seconds") == VLLM_TOKEN_LATENCY
    assert buckets(registry, "vllm:request_time_per_output_token_seconds") == VLLM_TOKEN_LATENCY
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        assert buckets(registry, f"vllm:{name}") == VLLM_REQUEST_LATENCY
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_prefill_kv_computed_tokens"):
        assert buckets(registry, f"vllm:{name}") == TOKENS_1_2_5_TO_2048
    assert buckets(registry, "vllm:iteration_tokens_total") == ITERATION_TO_2048


def test_bucket_sizes_follow_config() -> None:
    _, registry = make_logger(max_model_len=100, max_num_batched_tokens=16384)
    assert buckets(registry, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]
    assert buckets(registry, "vllm:iteration_tokens_total") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def test_custom_histogram_buckets_replace_a_familys_bounds() -> None:
    """vLLM's --custom-histogram-buckets: a family's bounds replace every histogram's in it;
    families left out keep vLLM's defaults."""
    custom = check_histogram_buckets({"request_latency": [0.01, 0.05, 0.1], "inter_token_latency": [0.002, 1],
                                      "request_tokens": [4, 64], "iteration_tokens": [16, 256]})
    registry = CollectorRegistry()
    PrometheusStatLogger(MODEL, EngineConfig(), registry=registry, histogram_buckets=custom)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds"):
        assert buckets(registry, f"vllm:{name}") == [0.01, 0.05, 0.1]
    assert buckets(registry, "vllm:inter_token_latency_seconds") == [0.002, 1.0]
    assert buckets(registry, "vllm:request_time_per_output_token_seconds") == [0.002, 1.0]
    assert buckets(registry, "vllm:request_prompt_tokens") == [4, 64]
    assert buckets(registry, "vllm:iteration_tokens_total") == [16, 256]
    assert buckets(registry, "vllm:time_to_first_token_seconds") == VLLM_TTFT


@pytest.mark.parametrize("bad,message", [
    ({"latency": [1]}, "unknown bucket family 'latency'"),
    ({"request_latency": []}, "non-empty list"),
    ({"request_latency": [0.5, 0.1]}, "strictly increasing"),
    ({"request_latency": [0, 1]}, "greater than 0"),
    ({"request_latency": [True, 2]}, "must be a number"),
    ([0.1], "JSON object"),
])
def test_custom_histogram_buckets_refused_with_the_reason(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_histogram_buckets(bad)


def test_labels_and_zero_valued_finish_reasons() -> None:
    _, registry = make_logger()
    for reason in ("stop", "length", "abort", "error"):
        assert value(registry, "vllm:request_success_total", finished_reason=reason) == 0.0
    assert value(registry, "vllm:num_requests_running") == 0.0


def test_gauges_and_counters_exact() -> None:
    logger, registry = make_logger()
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.375,
                                 num_blocks_total=64, num_blocks_free=40, num_blocks_cached=5,
                                 num_tokens_held=300, num_slots_reserved=384,
                                 prefix_cache_queries=100, prefix_cache_hits=32),
                  IterationStats(num_prompt_tokens=100, num_generation_tokens=3,
                                 num_preemptions=1, step_duration=0.02))
    logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.125,
                                 num_blocks_total=64, prefix_cache_queries=120,
                                 prefix_cache_hits=48),
                  IterationStats(num_prompt_tokens=20, num_generation_tokens=1))
    assert value(registry, "vllm:num_requests_running") == 1
    assert value(registry, "vllm:num_requests_waiting") == 0
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.125
    assert value(registry, "vllm:prompt_tokens_total") == 120
    assert value(registry, "vllm:generation_tokens_total") == 4
    assert value(registry, "vllm:num_preemptions_total") == 1
    assert value(registry, "vllm:prefix_cache_queries_total") == 120
    assert value(registry, "vllm:prefix_cache_hits_total") == 48
    assert value(registry, "pagoda:kv_blocks") == 64
    assert value(registry, "vllm:iteration_tokens_total_count") == 2
    assert value(registry, "vllm:iteration_tokens_total_sum") == 124
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="128.0") == 2
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="64.0") == 1
    assert value(registry, "pagoda:engine_step_duration_seconds_count") == 1
    assert value(registry, "pagoda:engine_step_duration_seconds_sum") == 0.02


def test_prefix_cache_totals_become_counter_increases() -> None:
    logger, registry = make_logger()
    for queries, hits in ((100, 40), (100, 40), (160, 50), (30, 10)):  # the last one restarted
        logger.record(SchedulerStats(prefix_cache_queries=queries, prefix_cache_hits=hits), None)
    assert value(registry, "vllm:prefix_cache_queries_total") == 190
    assert value(registry, "vllm:prefix_cache_hits_total") == 60


def test_iteration_tokens_are_the_tokens_each_step_computed() -> None:
    logger, registry = make_logger()
    # A chunked 300-token prompt: the step finishing it reports all 300 prompt tokens but only
    # computed its last 44-token chunk (plus one decode).
    logger.record(None, IterationStats(num_prompt_tokens=300, num_generation_tokens=2,
                                       num_scheduled_tokens=45))
    assert value(registry, "vllm:iteration_tokens_total_sum") == 45
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="32.0") == 0
    assert value(registry, "vllm:iteration_tokens_total_bucket", le="64.0") == 1


def test_pagoda_kv_gauges() -> None:
    logger, registry = make_logger()
    logger.record(SchedulerStats(num_blocks_total=64, num_blocks_free=40, num_blocks_cached=5,
                                 num_tokens_held=300, num_slots_reserved=384), None)
    assert value(registry, "pagoda:kv_blocks_free") == 40
    assert value(registry, "pagoda:kv_blocks_cached") == 5
    assert value(registry, "pagoda:kv_tokens_held") == 300
    assert value(registry, "pagoda:kv_slots_reserved") == 384


def test_idle_step_is_not_an_iteration() -> None:
    logger, registry = make_logger()
    logger.record(SchedulerStats(), IterationStats())
    assert value(registry, "vllm:iteration_tokens_total_count") == 0
    assert value(registry, "pagoda:engine_step_duration_seconds_count") == 0


def test_token_latency_histograms_exact() -> None:
    logger, registry = make_logger()
    logger.record(None, IterationStats(time_to_first_tokens=[0.003, 0.05, 3.0],
                                       inter_token_latencies=[0.02, 0.02, 0.3]))
    ttft = "vllm:time_to_first_token_seconds"
    assert value(registry, f"{ttft}_bucket", le="0.001") == 0
    assert value(registry, f"{ttft}_bucket", le="0.005") == 1
    assert value(registry, f"{ttft}_bucket", le="0.06") == 2
    assert value(registry, f"{ttft}_bucket", le="2.5") == 2
    assert value(registry, f"{ttft}_bucket", le="5.0") == 3
    assert value(registry, f"{ttft}_count") == 3
    assert value(registry, f"{ttft}_sum") == pytest.approx(3.053)
    itl = "vllm:inter_token_latency_seconds"
    assert value(registry, f"{itl}_bucket", le="0.025") == 2
    assert value(registry, f"{itl}_bucket", le="0.3") == 3
    assert value(registry, f"{itl}_sum") == pytest.approx(0.34)


def test_every_finish_reason_in_every_per_request_metric() -> None:
    logger, registry = make_logger()
    logger.record(None, IterationStats(finished_requests=[
        finished("stop"), finished("length", num_generation_tokens=16),
        finished("abort", num_cached_tokens=8), finished("error", num_generation_tokens=1)]))
    for reason in ("stop", "length", "abort", "error"):
        assert value(registry, "vllm:request_success_total", finished_reason=reason) == 1
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_max_tokens",
                 "request_prefill_kv_computed_tokens"):
        assert value(registry, f"vllm:{name}_count") == 4, name
    assert value(registry, "vllm:e2e_request_latency_seconds_sum") == 8.0
    assert value(registry, "vllm:e2e_request_latency_seconds_bucket", le="1.5") == 0
    assert value(registry, "vllm:e2e_request_latency_seconds_bucket", le="2.0") == 4
    assert value(registry, "vllm:request_generation_tokens_sum") == 4 + 16 + 4 + 1
    assert value(registry, "vllm:request_generation_tokens_bucket", le="5.0") == 3
    assert value(registry, "vllm:request_prefill_kv_computed_tokens_sum") == 10 + 10 + 2 + 10
    # The one-token request has no time per output token.
    assert value(registry, "vllm:request_time_per_output_token_seconds_count") == 3
    assert value(registry, "vllm:request_time_per_output_token_seconds_sum") == 0.75


def test_request_aborted_in_queue_counts_only_where_it_belongs() -> None:
    logger, registry = make_logger()
    logger.record(None, IterationStats(finished_requests=[finished(
        "abort", num_generation_tokens=0, max_tokens_param=None, e2e_latency=3.0, queue_time=3.0,
        prefill_time=0.0, decode_time=0.0, inference_time=0.0, mean_time_per_output_token=0.0)]))
    assert value(registry, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(registry, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(registry, "vllm:request_queue_time_seconds_sum") == 3.0
    assert value(registry, "vllm:request_prompt_tokens_sum") == 10
    assert value(registry, "vllm:request_generation_tokens_count") == 1
    assert value(registry, "vllm:request_params_max_tokens_count") == 0
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert value(registry, f"vllm:{name}_count") == 0, name


def test_failed_requests_by_reason() -> None:
    logger, registry = make_logger()
    logger.record(None, IterationStats(failed_requests={"engine_error": 2}))
    logger.record(None, IterationStats(failed_requests={"engine_error": 1, "oom": 1}))
    assert value(registry, "pagoda:request_failures_total", reason="engine_error") == 3
    assert value(registry, "pagoda:request_failures_total", reason="oom") == 1


def test_cache_config_info_learns_the_pool_size() -> None:
    logger, registry = make_logger()
    info = {"engine": "0", "block_size": "16", "enable_prefix_caching": "True", "cache_dtype": "auto",
            "gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": "None",
            "num_kv_blocks": "None", "tensor_parallel_size": "1", "pipeline_parallel_size": "1",
            "disable_hybrid_kv_cache_manager": "False"}
    assert registry.get_sample_value("vllm:cache_config_info",
                                     {**info, "num_gpu_blocks": "None"}) == 1
    logger.record(SchedulerStats(num_blocks_total=512), None)
    assert registry.get_sample_value("vllm:cache_config_info",
                                     {**info, "num_gpu_blocks": "512"}) == 1
    assert registry.get_sample_value("vllm:cache_config_info",
                                     {**info, "num_gpu_blocks": "None"}) is None


def test_new_logger_replaces_the_previous_one_in_a_registry() -> None:
    first, registry = make_logger()
    first.record(None, IterationStats(num_prompt_tokens=5))
    PrometheusStatLogger(MODEL, EngineConfig(), registry=registry)
    assert value(registry, "vllm:prompt_tokens_total") == 0


def test_render_metrics() -> None:
    logger, registry = make_logger()
    logger.record(SchedulerStats(num_running_reqs=2), None)
    body, content_type = render_metrics(registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-model"} 2.0' in body.decode()


def test_default_stat_loggers() -> None:
    loggers = default_stat_loggers(MODEL, EngineConfig())
    assert [type(x) for x in loggers] == [PrometheusStatLogger, LoggingStatLogger]
    quiet = default_stat_loggers(MODEL, EngineConfig(log_stats=False))
    assert [type(x) for x in quiet] == [PrometheusStatLogger]
    assert b"vllm:num_requests_running" in render_metrics()[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(clock=clock)
    stat_logger.record(SchedulerStats(num_running_reqs=5, prefix_cache_queries=300,
                                      prefix_cache_hits=60),
                       IterationStats(num_prompt_tokens=400, num_generation_tokens=40,
                                      num_preemptions=1))
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.425,
                                      prefix_cache_queries=400, prefix_cache_hits=100),
                       IterationStats(num_prompt_tokens=100, num_generation_tokens=60))
    clock.now += 5.0
    with caplog.at_level(logging.DEBUG, logger="pagoda"):
        stat_logger.log()
        clock.now += 5.0
        stat_logger.record(SchedulerStats(prefix_cache_queries=400, prefix_cache_hits=100),
                           IterationStats())
        stat_logger.log()
    busy, idle = caplog.records
    assert (busy.name, busy.levelno) == ("pagoda", logging.INFO)
    assert busy.getMessage() == (
        "Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 "
        "tokens/s, Running: 3 reqs, Waiting: 1 reqs, Preemptions: 1, KV cache usage: 42.5%, "
        "Prefix cache hit rate: 25.0%")
    assert idle.levelno == logging.DEBUG
    assert idle.getMessage() == (
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 0 reqs, Waiting: 0 reqs, Preemptions: 0, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 25.0%")


def test_log_line_stuck_engine_is_not_idle(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(engine_index=1, clock=clock)
    stat_logger.record(SchedulerStats(num_waiting_reqs=4), None)
    clock.now += 5.0
    with caplog.at_level(logging.DEBUG, logger="pagoda"):
        stat_logger.log()
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("Engine 001: Avg prompt throughput: 0.0 tokens/s")
    assert "Waiting: 4 reqs" in record.getMessage()


def test_kv_memory_report() -> None:
    report = dict(pool_bytes=64 * 1024**2, num_blocks=512, block_size=16, num_blocks_free=212,
                  num_blocks_cached=40, tokens_held=4700, slots_reserved=4800, slots_unused=100,
                  contiguous_reservation_tokens=65536, contiguous_reservation_bytes=512 * 1024**2)
    assert format_kv_memory_report(report) == "\n".join([
        "KV cache pool: 64.0 MiB, 512 blocks x 16 tokens = 8192 token slots (8.0 KiB per slot)",
        "  blocks: 300 in use, 212 free, 40 holding cached prefixes",
        "  running requests: 4700 tokens held in 4800 reserved slots (37.5 MiB); 100 slots "
        "unused (2.1% of reserved)",
        "  contiguous max-length reservation for the same requests: 65536 slots (512.0 MiB), "
        "13.7x what paging reserves",
    ])
    with pytest.raises(ValueError, match="slots_unused"):
        format_kv_memory_report({k: v for k, v in report.items() if k != "slots_unused"})
