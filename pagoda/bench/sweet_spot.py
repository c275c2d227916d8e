"""Reading a sweep: the sweet spot, the knee, the cost per token and the break-even with an API.

Rows are `bench sweep` points (one dict each: the swept value, output throughput, P50/P99
latencies in ms, failed requests). Every function here is plain arithmetic on them.

- **Sweet spot with an SLO** (`--slo-ms`): the highest-throughput point whose P99 of the
  judged latency is within the SLO and which had no failed request (ties: less load).
- **Knee** (the sweet spot without an SLO): walk up the sweep from the lightest load and stop
  before the first point that (a) had a failed request, (b) gained less than 10% output
  throughput per doubling of load over the point before it (the gains flatten), or (c) whose
  P99 latency has grown, relative to the lightest load, more than its throughput has (the
  latency curve crosses the throughput curve when both are drawn relative to their first
  point). The knee is the last point reached.
- **Cost**: a million output tokens cost price_per_hour / (output tok/s x 3600) x 10^6.
- **Break-even with an API** billing `api_price_per_mtok` per million output tokens: the
  machine costs price_per_hour x 730 h a month whether busy or not, so it is cheaper above
  price_per_hour x 730 / api_price_per_mtok x 10^6 output tokens a month, provided it can
  produce them (its capacity at the sweet spot: output tok/s x 3600 x 730).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

HOURS_PER_MONTH = 730.0  # 8,760 h / 12
KNEE_MIN_GAIN = 0.10  # throughput gain per doubling of load below which gains have flattened


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


def _doublings(low: float, high: float) -> float:
    """How many doublings of load lead from `low` to `high` (one for an unbounded rate)."""
    return 1.0 if math.isinf(high) else math.log2(high / low)


def find_knee(rows: Sequence[dict[str, Any]], x_key: str = "max_concurrency",
              metric: str = "itl", min_gain: float = KNEE_MIN_GAIN,
              percentile: str = "p99") -> dict[str, Any] | None:
    """The last point before throughput gains flatten or latency climbs (the module's rule).

    Returns None when the lightest point failed or lacks the figures.
    """
    key = f"{percentile}_{metric}_ms"
    ordered = sorted(rows, key=lambda r: float(r[x_key]))
    if not ordered or not _usable(ordered[0], key):
        return None
    first = knee = ordered[0]
    for row in ordered[1:]:
        if not _usable(row, key):
            break
        gain = row["output_throughput"] / knee["output_throughput"] - 1.0
        if gain < min_gain * _doublings(float(knee[x_key]), float(row[x_key])):
            break
        if row[key] / first[key] > row["output_throughput"] / first["output_throughput"]:
            break
        knee = row
    return knee


def _usable(row: dict[str, Any], key: str) -> bool:
    return (not row.get("failed") and (row.get("output_throughput") or 0) > 0
            and (row.get(key) or 0) > 0)


def recommended_max_num_seqs(best: dict[str, Any], x_key: str) -> int:
    """The server batch limit that reproduces the sweet spot."""
    if x_key == "max_concurrency":
        return int(best[x_key])
    return max(1, int(best.get("max_concurrent_requests") or 1))


def break_even(price_per_hour: float | None, api_price_per_mtok: float | None,
               output_tokens_per_s: float) -> dict[str, Any] | None:
    """Where the measured machine becomes cheaper than an API (None without both prices).

    Args:
        price_per_hour: what the machine costs an hour (USD), busy or idle.
        api_price_per_mtok: what the API charges per million output tokens (USD).
        output_tokens_per_s: the machine's output throughput at the chosen point.
    """
    if price_per_hour is None or not api_price_per_mtok or api_price_per_mtok <= 0:
        return None
    monthly = price_per_hour * HOURS_PER_MONTH
    tokens = monthly / api_price_per_mtok * 1e6
    capacity = output_tokens_per_s * 3600.0 * HOURS_PER_MONTH
    return {
        "api_price_per_mtok": api_price_per_mtok,
        "price_per_hour": price_per_hour,
        "machine_cost_per_month": monthly,
        "break_even_tokens_per_month": tokens,
        "capacity_tokens_per_month": capacity,
        "break_even_utilization": tokens / capacity if capacity > 0 else None,
        "cost_per_mtok_at_capacity": cost_per_million_tokens(output_tokens_per_s, price_per_hour),
        "reachable": capacity > 0 and tokens <= capacity,
    }


def analyze(rows: Sequence[dict[str, Any]], x_key: str, slo_metric: str, slo_ms: float | None,
            price_per_hour: float | None, api_price_per_mtok: float | None) -> dict[str, Any]:
    """The sweep's verdict: sweet spot (SLO rule, else the knee), its batch size, break-even."""
    knee = find_knee(rows, x_key, slo_metric)
    best = choose_sweet_spot(rows, slo_metric, slo_ms, x_key) if slo_ms else knee
    return {
        "sweet_spot": best,
        "sweet_spot_rule": "slo" if slo_ms else "knee",
        "knee": knee,
        "recommended_max_num_seqs": recommended_max_num_seqs(best, x_key) if best else None,
        "break_even": (break_even(price_per_hour, api_price_per_mtok, best["output_throughput"])
                       if best else None),
    }


def describe(summary: dict[str, Any], x_key: str) -> str:
    """The verdict in words: the sweet spot and the rule that chose it, then the break-even."""
    metric = f"P99 {summary['slo_metric'].upper()}"
    best = summary["sweet_spot"]
    if summary["sweet_spot_rule"] == "slo":
        rule = f"{metric} <= {summary['slo_ms']:g} ms"
        if best is None:
            return f"No point meets {rule}: lower the load or relax the SLO."
    else:
        rule = (f"knee: last point before output throughput gains fall under "
                f"{KNEE_MIN_GAIN:.0%} per doubling or {metric} grows faster than throughput")
        if best is None:
            return "No knee: the lightest point failed or has no figures."
    latency = best[f"p99_{summary['slo_metric']}_ms"]
    lines = [f"Sweet spot ({rule}): {x_key} = {best[x_key]:g}, "
             f"{best['output_throughput']:.1f} output tok/s, {metric} {latency:.1f} ms -> serve with "
             f"--max-num-seqs {summary['recommended_max_num_seqs']}"]
    if summary["sweet_spot_rule"] == "slo" and summary.get("knee") is not None:
        lines.append(f"(The knee, without the SLO: {x_key} = {summary['knee'][x_key]:g}.)")
    if summary.get("break_even"):
        lines.append(describe_break_even(summary["break_even"]))
    return "\n".join(lines)


def describe_break_even(b: dict[str, Any]) -> str:
    head = (f"Against an API at USD {b['api_price_per_mtok']:g} per million output tokens, the "
            f"machine at USD {b['price_per_hour']:g}/h (USD {b['machine_cost_per_month']:,.0f} "
            f"a month) ")
    if not b["reachable"]:
        return (head + "is never cheaper: even fully loaded it costs USD "
                f"{b['cost_per_mtok_at_capacity']:.3f} per million output tokens.")
    return (head + f"is cheaper above {b['break_even_tokens_per_month'] / 1e6:,.1f} M output "
            f"tokens a month ({b['break_even_utilization']:.0%} of its "
            f"{b['capacity_tokens_per_month'] / 1e6:,.0f} M capacity at the sweet spot; USD "
            f"{b['cost_per_mtok_at_capacity']:.3f} per million at full load).")
