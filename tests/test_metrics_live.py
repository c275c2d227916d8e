"""LiveStatLogger: exact rolling-window figures on a fake clock, and safe concurrent reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pagoda.metrics.live import LiveStatLogger, percentiles_ms
from pagoda.stats import FinishedRequestStats, IterationStats, SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished(reason: str = "stop") -> FinishedRequestStats:
    return FinishedRequestStats(reason, 10, 5, None, 1.0, 0.1, 0.2, 0.7, 0.9, 0.1)


def test_gauges_come_from_the_latest_scheduler_snapshot() -> None:
    live = LiveStatLogger(clock=FakeClock())
    assert live.snapshot()["ttft_ms"] is None and live.snapshot()["prefix_cache_hit_rate"] is None
    live.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25), None)
    live.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5), None)
    s = live.snapshot()
    assert (s["num_requests_running"], s["num_requests_waiting"], s["kv_cache_usage"]) == (1, 0, 0.5)


def test_throughput_over_the_rate_window_and_percentiles_over_the_window() -> None:
    clock = FakeClock()
    live = LiveStatLogger(window_s=60, rate_window_s=10, clock=clock)
    clock.now += 30
    live.record(None, IterationStats(num_prompt_tokens=100, num_generation_tokens=4,
                                     time_to_first_tokens=[0.1, 0.3],
                                     inter_token_latencies=[0.02, 0.04]))
    clock.now += 25  # the first step is now outside the 10 s rate window, inside the 60 s one
    live.record(None, IterationStats(num_generation_tokens=30, inter_token_latencies=[0.06],
                                     finished_requests=[finished("stop"), finished("length")]))
    s = live.snapshot()
    assert s["generation_tokens_per_s"] == pytest.approx(30 / 10)
    assert s["prompt_tokens_per_s"] == 0.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"] == pytest.approx(percentiles_ms([0.02, 0.04, 0.06]))
    assert s["itl_ms"]["p50"] == pytest.approx(40.0)
    assert s["num_finished_requests"] == 2
    assert s["finish_reasons"] == {"length": 1, "stop": 1}
    clock.now += 40  # 65 s after the first step: its samples leave the window
    s = live.snapshot()
    assert s["ttft_ms"] is None and s["num_itl_samples"] == 1
    assert s["totals"] == {"prompt_tokens": 100, "generation_tokens": 34, "finished_requests": 2}


def test_rates_just_after_start_divide_by_the_time_elapsed() -> None:
    clock = FakeClock()
    live = LiveStatLogger(clock=clock)
    clock.now += 2
    live.record(None, IterationStats(num_generation_tokens=10))
    assert live.snapshot()["generation_tokens_per_s"] == pytest.approx(5.0)


def test_prefix_hit_rate_from_the_increase_of_running_totals() -> None:
    clock = FakeClock()
    live = LiveStatLogger(clock=clock)
    live.record(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=0), IterationStats())
    clock.now += 1
    live.record(SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=80), IterationStats())
    assert live.snapshot()["prefix_cache_hit_rate"] == pytest.approx(80 / 200)
    clock.now += 61  # both lookups left the window; a restarted counter counts from 0
    live.record(SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=10), None)
    assert live.snapshot()["prefix_cache_hit_rate"] == pytest.approx(1.0)


def test_window_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="rate_window_s"):
        LiveStatLogger(window_s=5, rate_window_s=10)


def test_reads_from_another_thread_while_the_engine_records() -> None:
    live = LiveStatLogger()
    steps, errors = 2000, []

    def engine() -> None:
        for i in range(steps):
            live.record(SchedulerStats(num_running_reqs=i % 7),
                        IterationStats(num_generation_tokens=1, inter_token_latencies=[0.01],
                                       time_to_first_tokens=[0.1] if i % 10 == 0 else []))

    def reader() -> None:
        try:
            for _ in range(300):
                s = live.snapshot()
                assert s["num_itl_samples"] <= steps
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=engine), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = live.snapshot()
    assert s["totals"]["generation_tokens"] == steps and s["num_itl_samples"] == steps
    assert s["num_ttft_samples"] == steps // 10
    assert s["itl_ms"]["p99"] == pytest.approx(10.0)


def test_percentiles_match_numpy() -> None:
    samples = [0.5, 0.1, 0.2, 0.9, 0.3]
    expected = np.percentile(np.array(samples) * 1000, [50, 90, 99])
    assert list(percentiles_ms(samples).values()) == pytest.approx(list(expected))
