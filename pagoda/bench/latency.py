"""`pagoda bench latency`: the wall time of one batch, and single-stream decode speed.

Like `vllm bench latency`: a batch of --batch-size random prompts of --input-len tokens,
each generating exactly --output-len tokens, timed over --num-iters runs after
--num-iters-warmup; prefix caching is off so every run prefills. The decode rate comes from
the difference between full runs and prefill-only runs (one output token):
decode tok/s = batch * (output_len - 1) / (mean full latency - mean prefill latency),
computed the same way for pagoda and for transformers (`--backend hf` or `both`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.bench.backends import Backend, make_backend, timed
from pagoda.bench.datasets import load_tokenizer, random_requests
from pagoda.bench.throughput import (
    add_offline_args,
    engine_kwargs,
    environment,
    token_prompts,
    write_json,
)

PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclass
class LatencyResult:
    backend: str
    batch_size: int
    input_len: int
    output_len: int
    latencies_s: list[float]
    prefill_latencies_s: list[float]

    @property
    def avg_latency_s(self) -> float:
        return float(np.mean(self.latencies_s))

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens/s over the whole batch (per stream when the batch is 1)."""
        decode_s = self.avg_latency_s - float(np.mean(self.prefill_latencies_s))
        return self.batch_size * (self.output_len - 1) / decode_s if decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "batch_size": self.batch_size,
                "input_len": self.input_len, "output_len": self.output_len,
                "avg_latency": self.avg_latency_s, "latencies": self.latencies_s,
                "percentiles": {str(p): float(np.percentile(self.latencies_s, p))
                                for p in PERCENTILES},
                "avg_prefill_latency": float(np.mean(self.prefill_latencies_s)),
                "decode_tokens_per_second": self.decode_tokens_per_s}


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_offline_args(parser)
    add = parser.add_argument
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=128)
    add("--batch-size", type=int, default=1)
    add("--num-iters-warmup", type=int, default=1)
    add("--num-iters", type=int, default=5)
    add("--hf-max-batch-size", "--hf-batch-size", dest="hf_batch_size", type=int, default=None,
        help="Default: --batch-size (one static batch).")


def measure(backend: Backend, prompts: list[list[int]], output_len: int, num_warmups: int,
            num_iters: int) -> LatencyResult:
    """Times full runs and prefill-only runs of one batch."""
    if output_len < 2 or num_iters < 1:
        raise ValueError(f"need output_len >= 2 and num_iters >= 1, got {output_len}, {num_iters}.")
    full = [output_len] * len(prompts)
    for _ in range(num_warmups):
        backend.generate(prompts, full)
    latencies = [timed(backend, prompts, full)[0] for _ in range(num_iters)]
    prefill = [timed(backend, prompts, [1] * len(prompts))[0] for _ in range(num_iters)]
    return LatencyResult(backend.name, len(prompts), len(prompts[0]), output_len, latencies,
                         prefill)


def format_result(result: LatencyResult) -> str:
    """vLLM's lines, plus the decode rate."""
    lines = [f"[{result.backend}] Avg latency: {result.avg_latency_s} seconds"]
    for p in PERCENTILES:
        lines.append(f"{p}% percentile latency: {np.percentile(result.latencies_s, p)} seconds")
    lines.append(f"Decode throughput: {result.decode_tokens_per_s:.2f} tokens/s "
                 f"(batch {result.batch_size})")
    return "\n".join(lines)


def format_comparison(results: list[LatencyResult]) -> str:
    head = f"{'backend':<8}{'avg latency s':>15}{'prefill s':>11}{'decode tok/s':>14}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.backend:<8}{r.avg_latency_s:>15.3f}"
                     f"{float(np.mean(r.prefill_latencies_s)):>11.3f}"
                     f"{r.decode_tokens_per_s:>14.2f}")
    by_name = {r.backend: r for r in results}
    if "pagoda" in by_name and "hf" in by_name and by_name["hf"].decode_tokens_per_s > 0:
        ratio = by_name["pagoda"].decode_tokens_per_s / by_name["hf"].decode_tokens_per_s
        lines.append(f"pagoda / hf decode tokens/s: {ratio:.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> list[LatencyResult]:
    """The `bench latency` handler."""
    requests = random_requests(load_tokenizer(args.model), args.batch_size,
                               (args.input_len, args.input_len), (args.output_len, args.output_len),
                               seed=args.seed, as_text=False)
    prompts = token_prompts(requests)
    # NOTE: every iteration repeats the same prompts; a prefix cache would skip their prefill.
    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False}
    names = ["pagoda", "hf"] if args.backend == "both" else [args.backend]
    results = []
    for name in names:
        print(f"Loading {name} ({args.model}, {args.dtype})...")
        backend = make_backend(name, args.model, args.dtype, kwargs,
                               args.hf_batch_size or args.batch_size)
        results.append(measure(backend, prompts, args.output_len, args.num_iters_warmup,
                               args.num_iters))
        print(format_result(results[-1]))
        del backend
    print(format_comparison(results))
    if args.output_json:
        write_json(args.output_json, {"environment": environment(),
                                      "results": [r.to_dict() for r in results]})
    return results
