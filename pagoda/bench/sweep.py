"""`pagoda bench sweep`: `bench serve` over concurrencies (or rates), and the sweet spot.

Each point is one `bench serve` run against the same server with the same seeded workload.
The sweet spot is the point with the highest output throughput whose P99 of the chosen
latency (ITL by default) stays within the SLO and which had no failed request; its
concurrency is the `--max-num-seqs` to give the server: at that batch size the server keeps
every running stream within the SLO and queues the rest. With a price per hour, each point
also gets the cost of a million output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pagoda.bench.serve_command import (
    build_requests,
    build_settings,
    percentile_args,
    resolve_model,
    token_counter,
    tokenizer_for,
)
from pagoda.bench.serving import benchmark_result, print_result, run_benchmark, save_result

ROW_KEYS = ["completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "max_concurrent_requests",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms"]


def summary_row(x_key: str, x: float, result: dict[str, Any],
                price_per_hour: float | None) -> dict[str, Any]:
    """One CSV row: the swept value, vLLM's headline figures, and the cost when priced."""
    row: dict[str, Any] = {x_key: x}
    row.update({k: result.get(k) for k in ROW_KEYS})
    row["cost_per_million_output_tokens"] = cost_per_million_tokens(
        result["output_throughput"], price_per_hour)
    return row


def cost_per_million_tokens(tokens_per_s: float, price_per_hour: float | None) -> float | None:
    """What a million tokens cost at `tokens_per_s` on a machine billed `price_per_hour`."""
    if price_per_hour is None or tokens_per_s <= 0:
        return None
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def choose_sweet_spot(rows: Sequence[dict[str, Any]], slo_metric: str, slo_ms: float,
                      x_key: str = "max_concurrency", percentile: str = "p99"
                      ) -> dict[str, Any] | None:
    """The highest-throughput row whose `{percentile}_{slo_metric}_ms` is within `slo_ms`.

    Rows with a failed request never qualify; ties go to the smaller swept value. Returns
    None when no row meets the SLO.
    """
    key = f"{percentile}_{slo_metric}_ms"
    ok = [r for r in rows if not r.get("failed") and r.get(key) is not None and r[key] <= slo_ms]
    if not ok:
        return None
    return max(ok, key=lambda r: (r["output_throughput"], -float(r[x_key])))


def recommended_max_num_seqs(best: dict[str, Any], x_key: str) -> int:
    """The server batch limit that reproduces the sweet spot."""
    if x_key == "max_concurrency":
        return int(best[x_key])
    return max(1, int(best.get("max_concurrent_requests") or 1))


def parse_values(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]."""
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected a comma-separated list of positive numbers, got {text!r}.")
    return values


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--concurrencies", default=None,
                       help="Comma-separated max concurrencies (default 1,2,4,8,16).")
    group.add_argument("--request-rates", default=None,
                       help="Comma-separated request rates (req/s) instead of concurrencies.")
    add("--slo-metric", default="itl", choices=["ttft", "tpot", "itl", "e2el"])
    add("--slo-ms", type=float, default=None, help="P99 latency target in ms.")
    add("--price-per-hour", type=float, default=None, help="Machine price per hour (USD).")
    add("--output-dir", default=None, help="Default results/sweep-<date>.")
    parser.set_defaults(num_prompts=None)


def _sweep_points(args: argparse.Namespace) -> tuple[str, list[float]]:
    if args.request_rates:
        return "request_rate", parse_values(args.request_rates)
    return "max_concurrency", parse_values(args.concurrencies or "1,2,4,8,16")


def _num_prompts(args: argparse.Namespace, x_key: str, x: float) -> int:
    if args.num_prompts is not None:
        return int(args.num_prompts)
    return max(16, 4 * int(x)) if x_key == "max_concurrency" else 64


async def _run_point(args: argparse.Namespace, settings: Any, x_key: str, x: float,
                     tokenizer: Any, first: bool) -> dict[str, Any]:
    changes: dict[str, Any] = {x_key: int(x) if x_key == "max_concurrency" else x}
    if not first:
        changes["ready_check_timeout_s"] = 0.0
    point = dataclasses.replace(settings, **changes)
    requests = build_requests(args, tokenizer, _num_prompts(args, x_key, x))
    outputs, duration = await run_benchmark(point, requests)
    metrics, percentiles = percentile_args(args)
    percentiles = sorted({*percentiles, 50.0, 99.0})

    result = benchmark_result(point, outputs, duration, percentiles, token_counter(tokenizer))
    print_result(result, point, metrics, percentiles)
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    """The `bench sweep` handler: runs every point, writes CSV/JSON/PNG, names the sweet spot."""
    from pagoda.bench.plots import plot_sweep

    model = resolve_model(args)
    tokenizer = tokenizer_for(args, model)
    settings = build_settings(args, model)
    x_key, values = _sweep_points(args)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.output_dir or f"results/sweep-{date}")
    rows = []
    for i, x in enumerate(values):
        print(f"\n### sweep point {i + 1}/{len(values)}: {x_key} = {x}")
        result = asyncio.run(_run_point(args, settings, x_key, x, tokenizer, first=i == 0))
        save_result(result, out_dir / f"point-{x_key}-{x:g}.json")
        rows.append(summary_row(x_key, x, result, args.price_per_hour))
    best = choose_sweet_spot(rows, args.slo_metric, args.slo_ms, x_key) if args.slo_ms else None
    summary = {"date": date, "model": model, "api_url": settings.api_url, "swept": x_key,
               "slo_metric": args.slo_metric, "slo_ms": args.slo_ms,
               "price_per_hour": args.price_per_hour, "points": rows, "sweet_spot": best,
               "recommended_max_num_seqs":
                   recommended_max_num_seqs(best, x_key) if best else None}
    write_csv(rows, out_dir / "sweep.csv")
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    plot_sweep(rows, x_key, args.slo_metric, args.slo_ms, best, out_dir / "sweep.png")
    print(format_sweep_table(rows, x_key))
    print(describe_sweet_spot(summary, x_key))
    print(f"Wrote {out_dir}/sweep.csv, sweep.json and sweep.png")
    return summary


def format_sweep_table(rows: Sequence[dict[str, Any]], x_key: str) -> str:
    head = (f"{x_key:>16} {'out tok/s':>10} {'P50 TTFT':>10} {'P99 TTFT':>10} "
            f"{'P50 ITL':>9} {'P99 ITL':>9} {'failed':>7} {'$/Mtok':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cost = r["cost_per_million_output_tokens"]
        lines.append(f"{r[x_key]:>16g} {r['output_throughput']:>10.1f} "
                     f"{r['median_ttft_ms']:>10.1f} {r['p99_ttft_ms']:>10.1f} "
                     f"{r['median_itl_ms']:>9.1f} {r['p99_itl_ms']:>9.1f} {r['failed']:>7} "
                     f"{'-' if cost is None else f'{cost:.3f}':>8}")
    return "\n".join(lines)


def describe_sweet_spot(summary: dict[str, Any], x_key: str) -> str:
    if summary["slo_ms"] is None:
        return "No --slo-ms given: no sweet spot chosen."
    metric = f"P99 {summary['slo_metric'].upper()} <= {summary['slo_ms']:g} ms"
    best = summary["sweet_spot"]
    if best is None:
        return f"No point meets {metric}: lower the load or relax the SLO."
    return (f"Sweet spot ({metric}): {x_key} = {best[x_key]:g}, "
            f"{best['output_throughput']:.1f} output tok/s -> serve with "
            f"--max-num-seqs {summary['recommended_max_num_seqs']}")
