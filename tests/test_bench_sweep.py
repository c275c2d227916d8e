"""The sweep's choice of sweet spot, cost and summary table, on given data."""

from __future__ import annotations

import pytest

from pagoda.bench.sweep import (
    choose_sweet_spot,
    cost_per_million_tokens,
    format_sweep_table,
    parse_values,
    recommended_max_num_seqs,
    summary_row,
)


def row(c: int, out: float, p99_itl: float, p99_ttft: float = 100.0, failed: int = 0) -> dict:
    return {"max_concurrency": c, "output_throughput": out, "p99_itl_ms": p99_itl,
            "p99_ttft_ms": p99_ttft, "failed": failed, "max_concurrent_requests": c}


ROWS = [row(1, 50, 20, 80), row(2, 90, 35, 150), row(4, 150, 60, 400),
        row(8, 170, 130, 900), row(16, 160, 300, 2500)]


def test_sweet_spot_is_the_fastest_point_within_the_slo() -> None:
    assert choose_sweet_spot(ROWS, "itl", 100)["max_concurrency"] == 4
    assert choose_sweet_spot(ROWS, "itl", 130)["max_concurrency"] == 8  # the bound is inclusive
    assert choose_sweet_spot(ROWS, "itl", 1000)["max_concurrency"] == 8  # 16 is slower
    assert choose_sweet_spot(ROWS, "ttft", 500)["max_concurrency"] == 4
    assert choose_sweet_spot(ROWS, "itl", 10) is None


def test_points_with_failures_never_qualify_and_ties_go_to_less_concurrency() -> None:
    rows = [*ROWS[:3], row(8, 170, 90, failed=1), row(16, 150, 95)]
    best = choose_sweet_spot(rows, "itl", 100)
    assert best["max_concurrency"] == 4
    assert recommended_max_num_seqs(best, "max_concurrency") == 4


def test_rate_sweeps_recommend_the_observed_peak_concurrency() -> None:
    best = {"request_rate": 2.0, "max_concurrent_requests": 7}
    assert recommended_max_num_seqs(best, "request_rate") == 7


def test_cost_per_million_output_tokens() -> None:
    assert cost_per_million_tokens(1000.0, 3.6) == pytest.approx(1.0)
    assert cost_per_million_tokens(250.0, 0.9) == pytest.approx(1.0)
    assert cost_per_million_tokens(1000.0, None) is None
    assert cost_per_million_tokens(0.0, 1.0) is None


def test_summary_row_and_table() -> None:
    result = {"completed": 8, "failed": 0, "duration": 2.0, "request_throughput": 4.0,
              "output_throughput": 360.0, "total_token_throughput": 500.0,
              "max_concurrent_requests": 4, "median_ttft_ms": 10.0, "p99_ttft_ms": 30.0,
              "median_tpot_ms": 5.0, "p99_tpot_ms": 8.0, "median_itl_ms": 5.0,
              "p99_itl_ms": 9.0, "median_e2el_ms": 100.0, "p99_e2el_ms": 200.0}
    r = summary_row("max_concurrency", 4, result, price_per_hour=3.6)
    assert r["max_concurrency"] == 4 and r["p99_itl_ms"] == 9.0
    assert r["cost_per_million_output_tokens"] == pytest.approx(3.6 / (360 * 3600) * 1e6)
    table = format_sweep_table([r], "max_concurrency")
    assert "360.0" in table and "2.778" in table


def test_parse_values() -> None:
    assert parse_values("1,2, 4,inf") == [1.0, 2.0, 4.0, float("inf")]
    with pytest.raises(ValueError):
        parse_values("0,1")
