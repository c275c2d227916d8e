"""The sampler's draws, timed on one thread over rows of SmolLM2's 49,152 tokens (median of 30
calls): torch's exponential_ (the exponential race pagoda used, and vLLM's CPU sampler uses),
pagoda's inverse CDF from one uniform a row (`sampler.inverse_cdf`, of probabilities already
made), the whole draw from the logits on the CPU kernels (`ops.draw_rows`: temperature, softmax
and inverse CDF; against torch's softmax then `inverse_cdf`), top-p's candidates (torch's topk
and logsumexp, against `ops.top_candidates`), and the watermark's uniforms
(`watermark.philox_uniform`) in torch and on the CPU kernels.

    .venv/bin/python docs/benchmarks/sampling/draw_time.py [ROWS ...]   (default 1 16)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.sampler import inverse_cdf
from pagoda.watermark import philox_uniform

VOCAB = 49152


def median_ms(fn, calls: int = 30) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_rows(rows: int) -> None:
    logits = torch.randn(rows, VOCAB) * 4
    probs = logits.softmax(dim=-1)
    temps = torch.full((rows,), 0.8)
    uniforms = torch.rand(rows, dtype=torch.float64)
    contexts = torch.randint(0, VOCAB, (rows, 4))
    cases = {
        "exponential race (exponential_)": lambda: (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1),
        "inverse CDF, one uniform a row": lambda: inverse_cdf(probs, uniforms),
        "logits to tokens, torch + inverse CDF": lambda: inverse_cdf((logits / temps[:, None]).softmax(dim=-1), uniforms),
        "logits to tokens, CPU kernels": lambda: cpu_kernels.ops.draw_rows(logits, temps, uniforms),
        "256 candidates, torch topk + logsumexp": lambda: ((x := logits / temps[:, None]).topk(256), x.logsumexp(-1)),
        "256 candidates, CPU kernels": lambda: cpu_kernels.ops.top_candidates(logits, temps, 256),
        "1,024 candidates, CPU kernels": lambda: cpu_kernels.ops.top_candidates(logits, temps, 1024),
        "whole sort (torch)": lambda: (logits / temps[:, None]).sort(dim=-1, descending=True),
        "watermark uniforms, torch": lambda: philox_uniform(42, contexts, VOCAB),
        "watermark uniforms, CPU kernels": lambda: cpu_kernels.ops.philox_uniform(42, contexts, VOCAB),
    }
    for name, fn in cases.items():
        print(f"{rows:3d} rows  {name:40s} {median_ms(fn):8.2f} ms", flush=True)


def main(row_counts: list[int]) -> None:
    torch.set_num_threads(1)
    cpu_kernels.ops.set_num_threads(1)
    for rows in row_counts:
        time_rows(rows)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 16])
