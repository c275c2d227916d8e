"""`pagoda bench sweep`: `bench serve` over concurrencies (or rates), and the sweet spot.

Each point is one `bench serve` run against the same server with the same seeded workload
(`--preset` or the dataset flags). The verdict (`sweet_spot.py`): with `--slo-ms`, the fastest
point within the SLO; without, the knee of the curve; its concurrency is the `--max-num-seqs`
to give the server. With `--price-per-hour`, each point gets the cost of a million output
tokens, and with `--api-price-per-mtok` too, the monthly volume above which the machine is
cheaper than the API. `--from-json` redoes the verdict from a saved `sweep.json` (new prices,
another SLO) without sending a request.

Files (in `--result-dir`, alias `--output-dir`; default `results/sweep-<date>`): sweep.csv,
sweep.json (the points and the verdict), sweep.png, and one summary JSON per point
(per-request arrays only with `--save-detailed`).
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

from pagoda.bench.datasets import PRESETS
from pagoda.bench.report import summarize
from pagoda.bench.serve_command import (
    DEFAULTS,
    apply_preset,
    build_requests,
    build_settings,
    percentile_args,
    resolve_model,
    token_counter,
    tokenizer_for,
)
from pagoda.bench.serving import benchmark_result, print_result, run_benchmark, save_result
from pagoda.bench.sweet_spot import analyze, cost_per_million_tokens, describe

ROW_KEYS = ["completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "max_concurrent_requests",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms"]
DEFAULT_CONCURRENCIES = "1,2,4,8,16"


def summary_row(x_key: str, x: float, result: dict[str, Any],
                price_per_hour: float | None) -> dict[str, Any]:
    """One CSV row: the swept value, vLLM's headline figures, and the cost when priced."""
    row: dict[str, Any] = {x_key: x}
    row.update({k: result.get(k) for k in ROW_KEYS})
    row["cost_per_million_output_tokens"] = cost_per_million_tokens(
        result["output_throughput"], price_per_hour)
    return row


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
                       help=f"Comma-separated max concurrencies (default {DEFAULT_CONCURRENCIES}, "
                            "or the preset's).")
    group.add_argument("--request-rates", default=None,
                       help="Comma-separated request rates (req/s) instead of concurrencies.")
    add("--slo-metric", default=None, choices=["ttft", "tpot", "itl", "e2el"],
        help="The latency the sweep is judged on (default itl, or the preset's).")
    add("--slo-ms", type=float, default=None,
        help="P99 latency target in ms; without it the sweet spot is the knee.")
    add("--price-per-hour", type=float, default=None, help="Machine price per hour (USD).")
    add("--api-price-per-mtok", type=float, default=None,
        help="An API's price per million output tokens (USD), for the break-even.")
    add("--output-dir", default=None, help="Same as --result-dir.")
    add("--from-json", default=None, metavar="SWEEP_JSON",
        help="Recompute the verdict and costs from a saved sweep.json; sends no request.")


def _sweep_points(args: argparse.Namespace) -> tuple[str, list[float]]:
    if args.request_rates:
        return "request_rate", parse_values(args.request_rates)
    preset = PRESETS[args.preset].concurrencies if args.preset else DEFAULT_CONCURRENCIES
    return "max_concurrency", parse_values(args.concurrencies or preset)


def _num_prompts(args: argparse.Namespace, x_key: str, x: float) -> int:
    if args.num_prompts is not None:
        return int(args.num_prompts)
    return max(16, 4 * int(x)) if x_key == "max_concurrency" else 64


def result_dir(args: argparse.Namespace, date: str) -> Path:
    """--result-dir (vLLM's flag) or --output-dir; both only when they agree."""
    given = {d for d in (args.result_dir, args.output_dir) if d}
    if len(given) > 1:
        raise SystemExit(f"--result-dir and --output-dir disagree: {sorted(given)}; give one.")
    return Path(given.pop() if given else f"results/sweep-{date}")


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
    result["preset"] = args.preset
    print_result(result, point, metrics, percentiles)
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    """The `bench sweep` handler: runs every point, writes CSV/JSON/PNG, names the sweet spot."""
    if args.from_json:
        return reanalyze(args)
    apply_preset(args, [k for k in DEFAULTS if k not in ("num_prompts", "max_concurrency")])
    args.slo_metric = args.slo_metric or (PRESETS[args.preset].slo_metric if args.preset
                                          else "itl")
    model = resolve_model(args)
    tokenizer = tokenizer_for(args, model)
    settings = build_settings(args, model)
    x_key, values = _sweep_points(args)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = result_dir(args, date)
    rows = []
    for i, x in enumerate(values):
        print(f"\n### sweep point {i + 1}/{len(values)}: {x_key} = {x}")
        result = asyncio.run(_run_point(args, settings, x_key, x, tokenizer, first=i == 0))
        save_result(result if args.save_detailed else summarize(result),
                    out_dir / f"point-{x_key}-{x:g}.json")
        rows.append(summary_row(x_key, x, result, args.price_per_hour))
    summary = {"date": date, "model": model, "api_url": settings.api_url,
               "preset": args.preset, "swept": x_key, "slo_metric": args.slo_metric,
               "slo_ms": args.slo_ms, "price_per_hour": args.price_per_hour,
               "api_price_per_mtok": args.api_price_per_mtok, "points": rows}
    return report(summary, out_dir)


def reanalyze(args: argparse.Namespace) -> dict[str, Any]:
    """--from-json: the saved points under this command's SLO and prices (the file's if unset)."""
    summary = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    for key in ("slo_metric", "slo_ms", "price_per_hour", "api_price_per_mtok"):
        if getattr(args, key) is not None:
            summary[key] = getattr(args, key)
    summary["slo_metric"] = summary.get("slo_metric") or "itl"
    summary["analyzed_from"] = args.from_json
    for row in summary["points"]:
        row["cost_per_million_output_tokens"] = cost_per_million_tokens(
            row["output_throughput"], summary.get("price_per_hour"))
    out_dir = args.result_dir or args.output_dir
    return report(summary, Path(out_dir) if out_dir else None)


def report(summary: dict[str, Any], out_dir: Path | None) -> dict[str, Any]:
    """Adds the verdict to `summary`, prints it, and writes the files when `out_dir` is set."""
    rows, x_key = summary["points"], summary["swept"]
    summary.update(analyze(rows, x_key, summary["slo_metric"], summary.get("slo_ms"),
                           summary.get("price_per_hour"), summary.get("api_price_per_mtok")))
    print(format_sweep_table(rows, x_key))
    print(describe(summary, x_key))
    if out_dir is None:
        return summary
    write_csv(rows, out_dir / "sweep.csv")
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    plotted = _plot(summary, out_dir / "sweep.png")
    print(f"Wrote {out_dir}/sweep.csv, sweep.json{' and sweep.png' if plotted else ''}")
    return summary


def _plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        from pagoda.bench.plots import plot_sweep

        plot_sweep(summary["points"], summary["swept"], summary["slo_metric"],
                   summary.get("slo_ms"), summary["sweet_spot"], path,
                   rule=summary["sweet_spot_rule"])
    except ImportError as exc:
        print(f"No sweep.png: {exc}")
        return False
    return True


def format_sweep_table(rows: Sequence[dict[str, Any]], x_key: str) -> str:
    head = (f"{x_key:>16} {'out tok/s':>10} {'P50 TTFT':>10} {'P99 TTFT':>10} "
            f"{'P50 ITL':>9} {'P99 ITL':>9} {'P99 E2EL':>10} {'failed':>7} {'$/Mtok':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cost = r["cost_per_million_output_tokens"]
        lines.append(f"{r[x_key]:>16g} {r['output_throughput']:>10.1f} "
                     f"{r['median_ttft_ms']:>10.1f} {r['p99_ttft_ms']:>10.1f} "
                     f"{r['median_itl_ms']:>9.1f} {r['p99_itl_ms']:>9.1f} "
                     f"{r['p99_e2el_ms']:>10.1f} {r['failed']:>7} "
                     f"{'-' if cost is None else f'{cost:.3f}':>8}")
    return "\n".join(lines)
