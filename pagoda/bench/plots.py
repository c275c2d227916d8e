"""PNG figures for the benchmarks (matplotlib, headless Agg backend).

Only this module imports matplotlib, and only when a figure is drawn. matplotlib comes with
the `bench` extra (`pip install 'pagoda[bench]'`); without it, drawing raises ImportError
with that advice, and the benchmarks still write their CSV and JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'pagoda[bench]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory(traces: Sequence[Any], bytes_per_token: int, path: str | Path) -> Path:
    """The memory tetris: per policy, KV memory used vs held over the replay, and batch size.

    Args:
        traces: `memory.ReplayTrace` objects (policy, capacity, held, used, batch).
        bytes_per_token: KV bytes of one token, to label the axis in MiB.
        path: where the PNG goes.
    """
    plt = _pyplot()
    mib = bytes_per_token / 2**20
    fig, axes = plt.subplots(len(traces) + 1, 1, figsize=(9, 2.6 * (len(traces) + 1)),
                             sharex=True)
    for ax, trace in zip(axes, traces, strict=False):
        steps = range(trace.num_steps)
        used = [u * mib for u in trace.used]
        held = [h * mib for h in trace.held]
        ax.fill_between(steps, 0, used, step="post", color="tab:green", label="used (KV of tokens)")
        ax.fill_between(steps, used, held, step="post", color="tab:red", alpha=0.45,
                        label="held, wasted")
        ax.axhline(trace.capacity * mib, color="black", linewidth=0.8, linestyle="--",
                   label="pool")
        s = trace.summary()
        ax.set_title(f"{trace.policy}: {s['steps']} steps, max batch {s['max_batch']}, "
                     f"{s['wasted_pct_of_held']:.0f}% of held memory wasted", fontsize=10)
        ax.set_ylabel("KV MiB")
        ax.legend(loc="upper right", fontsize=8)
    for trace in traces:
        axes[-1].step(range(trace.num_steps), trace.batch, where="post", label=trace.policy)
    axes[-1].set_ylabel("running requests")
    axes[-1].set_xlabel("engine step")
    axes[-1].legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def plot_sweep(rows: Sequence[dict[str, Any]], x_key: str, slo_metric: str | None,
               slo_ms: float | None, best: dict[str, Any] | None, path: str | Path,
               rule: str = "slo") -> Path:
    """Throughput and P50/P99 latency against concurrency (or request rate).

    Args:
        rows: one dict per point with output_throughput and median/p99_{ttft,itl,tpot}_ms.
        x_key: the swept column ('max_concurrency' or 'request_rate').
        slo_metric: the judged latency ('ttft', 'tpot', 'itl' or 'e2el'), drawn as a line at
            slo_ms when given; E2EL is drawn only when it is the judged one.
        best: the sweet-spot row, marked when given.
        path: where the PNG goes.
        rule: what chose `best` ('slo' or 'knee'), for its label.
    """
    plt = _pyplot()
    xs = [float(r[x_key]) for r in rows]
    fig, (ax_tp, ax_lat) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_tp.plot(xs, [r["output_throughput"] for r in rows], "o-", label="output tok/s")
    ax_tp.plot(xs, [r["total_token_throughput"] for r in rows], "s--", label="total tok/s")
    ax_tp.set_ylabel("tokens/s")
    metrics = [("ttft", "tab:blue"), ("itl", "tab:orange"), ("tpot", "tab:green")]
    if slo_metric == "e2el":
        metrics.append(("e2el", "tab:red"))
    for metric, color in metrics:
        ax_lat.plot(xs, [r[f"median_{metric}_ms"] for r in rows], "o-", color=color,
                    label=f"P50 {metric.upper()}")
        ax_lat.plot(xs, [r[f"p99_{metric}_ms"] for r in rows], "^--", color=color,
                    label=f"P99 {metric.upper()}")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    if slo_metric and slo_ms:
        ax_lat.axhline(slo_ms, color="red", linewidth=1, label=f"SLO P99 {slo_metric.upper()}")
    if best is not None:
        bx = float(best[x_key])
        ax_tp.plot([bx], [best["output_throughput"]], "*", color="red", markersize=16,
                   label="sweet spot (knee)" if rule == "knee" else "sweet spot (SLO)")
        ax_lat.axvline(bx, color="red", linestyle=":", linewidth=1)
    _cost_axis(ax_tp, xs, rows)
    if x_key == "max_concurrency":
        ax_tp.set_xscale("log", base=2)
        ax_lat.set_xticks(xs, [f"{x:g}" for x in xs])
    ax_lat.set_xlabel("max concurrency" if x_key == "max_concurrency" else "request rate (req/s)")
    ax_tp.legend(fontsize=8)
    ax_lat.legend(fontsize=8, ncol=2)
    ax_tp.grid(alpha=0.3)
    ax_lat.grid(alpha=0.3)
    return _save(fig, path)


def _cost_axis(ax: Any, xs: list[float], rows: Sequence[dict[str, Any]]) -> None:
    """A second y axis with the cost per million output tokens, when the sweep was priced."""
    costs = [r.get("cost_per_million_output_tokens") for r in rows]
    if any(c is None for c in costs):
        return
    twin = ax.twinx()
    twin.plot(xs, costs, "d:", color="tab:purple", label="$ per 1M output tokens")
    twin.set_ylabel("$ per 1M output tokens", color="tab:purple")
    twin.legend(loc="center right", fontsize=8)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    _pyplot().close(fig)
    return path
