"""The sweep's verdict (sweet spot, knee, cost, break-even), files and flags, on given data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagoda.bench.cli import add_bench_parser, run_command
from pagoda.bench.sweep import format_sweep_table, parse_values, result_dir, summary_row
from pagoda.bench.sweet_spot import (
    HOURS_PER_MONTH,
    analyze,
    break_even,
    choose_sweet_spot,
    cost_per_million_tokens,
    describe,
    find_knee,
    recommended_max_num_seqs,
)


def row(c: float, out: float, p99_itl: float, p99_ttft: float = 100.0, failed: int = 0,
        x_key: str = "max_concurrency") -> dict:
    return {x_key: c, "output_throughput": out, "p99_itl_ms": p99_itl,
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
    r["cost_per_million_output_tokens"] = cost_per_million_tokens(360.0, 3.6)
    table = format_sweep_table([r], "max_concurrency")
    assert "360.0" in table and "2.778" in table


def test_parse_values() -> None:
    assert parse_values("1,2, 4,inf") == [1.0, 2.0, 4.0, float("inf")]
    with pytest.raises(ValueError):
        parse_values("0,1")


# The 2026-11-29 sweep in docs/benchmarks.md (concurrency, output tok/s, P99 ITL ms).
MEASURED = [row(1, 40.1, 31.2), row(2, 79.2, 37.9), row(4, 140.6, 44.3), row(8, 200.5, 142.0),
            row(16, 357.9, 81.7), row(32, 376.4, 268.8), row(64, 422.9, 399.7)]


def test_knee_stops_where_throughput_gains_flatten() -> None:
    # 16 -> 32 gains 5.2% for a doubling (< 10%); up to 16 every step gains more and P99 ITL
    # grows less than throughput (at 8: 4.6x the ITL of c1 for 5.0x its throughput)
    assert find_knee(MEASURED)["max_concurrency"] == 16
    # gains are pro-rated: +6% for 1.5x the load (0.58 doublings) is still above 10% a doubling
    assert find_knee([row(100, 100, 10), row(150, 106, 10)])["max_concurrency"] == 150
    assert find_knee([row(100, 100, 10), row(150, 105, 10)])["max_concurrency"] == 100


def test_knee_stops_where_latency_grows_faster_than_throughput() -> None:
    rows = [row(1, 100, 10), row(2, 190, 18), row(4, 300, 28), row(8, 420, 60)]
    assert find_knee(rows)["max_concurrency"] == 4  # at 8: ITL x6.0 against throughput x4.2
    assert find_knee(rows, metric="ttft")["max_concurrency"] == 8  # TTFT flat at 100 ms


def test_knee_never_passes_a_failed_point_and_needs_a_first_point() -> None:
    assert find_knee([row(1, 50, 20), row(2, 95, 22, failed=1), row(4, 180, 25)]
                     )["max_concurrency"] == 1
    assert find_knee([row(1, 50, 20, failed=2), row(2, 95, 22)]) is None
    assert find_knee([]) is None
    rates = [row(1.0, 50, 20, x_key="request_rate"), row(float("inf"), 60, 21, x_key="request_rate")]
    assert find_knee(rates, "request_rate")["request_rate"] == float("inf")  # +20% >= 10%


def test_without_an_slo_the_sweet_spot_is_the_knee() -> None:
    verdict = analyze(MEASURED, "max_concurrency", "itl", None, None, None)
    assert verdict["sweet_spot_rule"] == "knee" and verdict["sweet_spot"] is verdict["knee"]
    assert verdict["recommended_max_num_seqs"] == 16 and verdict["break_even"] is None
    with_slo = analyze(MEASURED, "max_concurrency", "itl", 50.0, None, None)
    assert with_slo["sweet_spot_rule"] == "slo" and with_slo["sweet_spot"]["max_concurrency"] == 4
    assert with_slo["knee"]["max_concurrency"] == 16
    text = describe({**with_slo, "slo_metric": "itl", "slo_ms": 50.0}, "max_concurrency")
    assert "max_concurrency = 4" in text and "--max-num-seqs 4" in text and "knee" in text


def test_break_even_against_an_api() -> None:
    # USD 0.10/h is USD 73 a month; at USD 0.50 per million tokens that buys 146 M tokens
    b = break_even(0.10, 0.50, 100.0)
    assert b["machine_cost_per_month"] == pytest.approx(0.10 * HOURS_PER_MONTH)
    assert b["break_even_tokens_per_month"] == pytest.approx(146e6)
    assert b["capacity_tokens_per_month"] == pytest.approx(100 * 3600 * 730)
    assert b["break_even_utilization"] == pytest.approx(146e6 / 262.8e6)
    assert b["reachable"] and b["cost_per_mtok_at_capacity"] == pytest.approx(0.10 / 0.36)
    # at 50 tok/s the machine cannot make 146 M tokens a month: never cheaper
    slow = break_even(0.10, 0.50, 50.0)
    assert not slow["reachable"] and slow["cost_per_mtok_at_capacity"] > 0.50
    assert break_even(None, 0.50, 100.0) is None and break_even(0.10, None, 100.0) is None
    summary = {**analyze(MEASURED, "max_concurrency", "itl", None, 0.10, 0.50),
               "slo_metric": "itl", "slo_ms": None}
    assert "cheaper above 146.0 M output tokens a month" in describe(summary, "max_concurrency")


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_result_dir_honours_vllms_flag() -> None:
    assert result_dir(bench_args("sweep", "--result-dir", "a"), "d") == Path("a")
    assert result_dir(bench_args("sweep", "--output-dir", "b"), "d") == Path("b")
    assert result_dir(bench_args("sweep", "--output-dir", "a", "--result-dir", "a"), "d") == Path("a")
    assert result_dir(bench_args("sweep"), "d") == Path("results/sweep-d")
    with pytest.raises(SystemExit, match="disagree"):
        result_dir(bench_args("sweep", "--output-dir", "a", "--result-dir", "b"), "d")


def test_from_json_recomputes_the_verdict_without_requests(tmp_path: Path) -> None:
    rows = [{**r, "completed": 16, "total_token_throughput": 2 * r["output_throughput"],
             "median_ttft_ms": 50.0, "median_itl_ms": 20.0, "median_tpot_ms": 20.0,
             "p99_tpot_ms": 25.0, "median_e2el_ms": 900.0, "p99_e2el_ms": 1200.0,
             "cost_per_million_output_tokens": None} for r in MEASURED]
    saved = tmp_path / "old" / "sweep.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps({"swept": "max_concurrency", "slo_metric": "itl", "slo_ms": None,
                                 "price_per_hour": None, "points": rows}))
    summary = run_command(bench_args("sweep", "--from-json", str(saved), "--price-per-hour",
                                     "0.10", "--api-price-per-mtok", "0.50",
                                     "--result-dir", str(tmp_path / "new")))
    assert summary["sweet_spot"]["max_concurrency"] == 16
    assert summary["points"][0]["cost_per_million_output_tokens"] == pytest.approx(
        cost_per_million_tokens(40.1, 0.10))
    assert summary["break_even"]["break_even_tokens_per_month"] == pytest.approx(146e6)
    written = json.loads((tmp_path / "new" / "sweep.json").read_text())
    assert written["recommended_max_num_seqs"] == 16
    assert (tmp_path / "new" / "sweep.png").stat().st_size > 0
