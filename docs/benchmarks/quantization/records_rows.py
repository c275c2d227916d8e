"""Gemma 3 270M's linear shapes in the record formats `--quantization gguf` gives them, M rows:
the records' GEMV (`ops.qgemv`), the dense fallback (`ops.dequantize` to fp32 + `F.linear`,
what steps above the GEMV's row bound ran), and the bf16 GEMM on the same weights.

Usage: python records_rows.py M [M ...]   (random weights; the weights stay in cache)
Prints per shape and M the best of 10 calls, ms.
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

SHAPES = [  # (layer, N, K, records, group)
    ("qkv (Q5_0/Q8_0)", 1536, 640, "int8", 32), ("o (Q4_K)", 640, 1024, "int4", 32),
    ("gate_up (Q5_0)", 4096, 640, "int8", 32), ("down (Q6_K)", 640, 2048, "int8", 16),
    ("down (Q4_K)", 640, 2048, "int4", 32),
]


def best_ms(fn: Callable[[], object], calls: int = 10) -> float:
    fn()
    return min(timeit.repeat(fn, repeat=calls, number=1)) * 1e3


def main() -> None:
    rows = [int(m) for m in sys.argv[1:]] or [1, 32, 128]
    gen = torch.Generator().manual_seed(0)
    print(f"{'layer':16} {'N x K':>11} {'records':>8}  {'M':>4}  {'GEMV':>8}  {'dense fp32':>10}  {'bf16 GEMM':>9}")
    for name, n, k, scheme, group in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        packed = packing.quantize_int4(w, group) if scheme == "int4" else packing.quantize_int8(w, group)
        fmt = ops.INT4 if scheme == "int4" else ops.INT8
        bf16 = ops.PackedWeight(w.bfloat16())
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            gemv = best_ms(lambda: ops.qgemv(x, packed, fmt, k, group))  # noqa: B023
            dense = best_ms(lambda: F.linear(x.float(), ops.dequantize(packed, fmt, k, group, torch.float32)))  # noqa: B023
            gemm = best_ms(lambda: ops.gemm(x, bf16))  # noqa: B023
            print(f"{name:16} {n:>5} x {k:<5} {scheme} g{group:<3} {m:4}  {gemv:8.3f}  {dense:10.3f}  {gemm:9.3f}")


if __name__ == "__main__":
    main()
