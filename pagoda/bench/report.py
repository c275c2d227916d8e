"""Serving metrics: request outputs -> vLLM's result dict and its printed block.

Keys and definitions follow `vllm bench serve`: TTFT from send to the first streamed text;
TPOT = (latency - TTFT) / (output tokens - 1) per request with more than one token; ITL is
every gap between streamed text chunks; E2EL is the whole request. Failed requests count in
`failed` and keep their error text in `errors`; they add no tokens and no latencies.
`summarize` drops the per-request arrays for saving (vLLM saves them only with
`--save-detailed`), keeping a few distinct error texts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagoda.bench.endpoints import RequestFuncOutput

LATENCY_METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


# The result's per-request arrays: what `--save-detailed` keeps and a summary leaves out.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                    "generated_texts", "errors")
MAX_ERROR_SAMPLES = 5


def percentile_key(p: float) -> str:
    """'99' for 99.0, '99.9' for 99.9 (vLLM's p99_ttft_ms / p99.9_ttft_ms keys)."""
    return str(int(p)) if int(p) == p else str(p)


def output_lengths(outputs: Sequence[RequestFuncOutput],
                   count_tokens: Callable[[str], int] | None) -> list[int]:
    """Output tokens per request: the server's usage, else the re-tokenized text; 0 if failed."""
    lens = []
    for out in outputs:
        if not out.success:
            lens.append(0)
        elif out.output_tokens is not None:
            lens.append(out.output_tokens)
        elif count_tokens is not None:
            lens.append(count_tokens(out.generated_text))
        else:
            lens.append(len(out.itl) + 1 if out.generated_text else 0)
    return lens


def input_lengths(outputs: Sequence[RequestFuncOutput]) -> list[int]:
    """Prompt tokens per request: the server's usage when it reports it, else the local count."""
    return [o.usage_prompt_tokens if o.usage_prompt_tokens is not None else o.prompt_len
            for o in outputs]


def _stats(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0]) * 1000.0
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        stats[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def _peaks(outputs: Sequence[RequestFuncOutput]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket, and peak concurrent requests."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    end = max(o.start_time + o.latency for o in done)
    buckets = np.zeros(int(math.ceil(end - t0)) + 1)
    events: list[tuple[float, int]] = []
    for o in done:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl] if o.generated_text else []:
            t += gap
            buckets[min(int(t - t0), len(buckets) - 1)] += 1
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    running = peak = 0
    for _, delta in sorted(events):
        running += delta
        peak = max(peak, running)
    return float(buckets.max()), peak


def calculate_metrics(
    outputs: Sequence[RequestFuncOutput],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    count_tokens: Callable[[str], int] | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The result dict of one benchmark run, with vLLM's keys."""
    in_lens = input_lengths(outputs)
    out_lens = output_lengths(outputs, count_tokens)
    ok = [i for i, o in enumerate(outputs) if o.success]
    total_in = sum(in_lens[i] for i in ok)
    total_out = sum(out_lens)
    series = _latency_series(outputs, out_lens)
    peak_tokens, peak_concurrency = _peaks(outputs)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": _goodput(outputs, out_lens, goodput_slos_ms, duration_s),
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
        "input_lens": in_lens,
        "output_lens": out_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for name, values in series.items():
        result.update(_stats(name, values, percentiles))
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The result without per-request arrays; up to 5 distinct errors in `error_samples`."""
    summary = {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}
    errors = list(dict.fromkeys(e for e in result.get("errors", []) if e))
    summary["error_samples"] = errors[:MAX_ERROR_SAMPLES]
    return summary


def _latency_series(outputs: Sequence[RequestFuncOutput],
                    out_lens: list[int]) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for out, n in zip(outputs, out_lens, strict=True):
        if not out.success:
            continue
        series["e2el"].append(out.latency)
        if not out.generated_text:
            continue  # NOTE: no text, no first token: a TTFT of 0 would flatter the stats
        series["ttft"].append(out.ttft)
        series["itl"].extend(out.itl)
        if n > 1:
            series["tpot"].append((out.latency - out.ttft) / (n - 1))
    return series


def _goodput(outputs: Sequence[RequestFuncOutput], out_lens: list[int],
             slos_ms: dict[str, float] | None, duration_s: float) -> float | None:
    """Requests/s that met every SLO (vLLM's --goodput ttft:MS tpot:MS e2el:MS)."""
    if not slos_ms:
        return None
    good = 0
    for out, n in zip(outputs, out_lens, strict=True):
        if not out.success:
            continue
        values = {"ttft": out.ttft, "e2el": out.latency,
                  "tpot": (out.latency - out.ttft) / (n - 1) if n > 1 else 0.0}
        good += all(values[k] * 1000.0 <= v for k, v in slos_ms.items())
    return good / duration_s


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_result_block(result: dict[str, Any], max_concurrency: int | None,
                        request_rate: float, metrics: Sequence[str],
                        percentiles: Sequence[float]) -> str:
    """vLLM's '=== Serving Benchmark Result ===' block."""
    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"])]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    lines += [_line("Benchmark duration (s):", float(result["duration"])),
              _line("Total input tokens:", result["total_input_tokens"]),
              _line("Total generated tokens:", result["total_output_tokens"]),
              _line("Request throughput (req/s):", float(result["request_throughput"]))]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", float(result["request_goodput"])))
    lines += [_line("Output token throughput (tok/s):", float(result["output_throughput"])),
              _line("Peak output token throughput (tok/s):",
                    float(result["max_output_tokens_per_s"])),
              _line("Peak concurrent requests:", float(result["max_concurrent_requests"])),
              _line("Total token throughput (tok/s):", float(result["total_token_throughput"]))]
    for name in metrics:
        short, header = LATENCY_METRICS[name]
        lines += [f"{header:-^50}",
                  _line(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])),
                  _line(f"Median {short} (ms):", float(result[f"median_{name}_ms"]))]
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"P{key} {short} (ms):", float(result[f"p{key}_{name}_ms"])))
    lines.append("=" * 50)
    return "\n".join(lines)
