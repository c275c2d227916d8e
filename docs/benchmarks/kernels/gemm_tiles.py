"""The bf16 GEMM's two tile kinds on this CPU (the avx512bf16 build): vdpbf16ps against fp32
FMAs on the weight widened in registers, over the same packed panels, at several row counts
for SmolLM2's two big shapes; best of 10 calls each, alternating, two threads; and what the
load-time probe (cpu_kernels/gemm_tiles.py) chose.
Usage: python docs/benchmarks/kernels/gemm_tiles.py
"""
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import gemm_tiles, ops

torch.set_num_threads(2)
lib = cpu_kernels.library()
assert lib is not None and lib.variant == "avx512bf16", "needs the avx512bf16 build"
ops.set_num_threads(2)
chosen = ops.GEMM_FMA_ROWS
print(f"load-time choice: {gemm_tiles.describe(chosen)}")
for n, k in ((3072, 576), (576, 1536)):
    w = ops.PackedWeight((torch.randn(n, k) * 0.05).to(torch.bfloat16))
    for rows in (1, 4, 16, 64, 256, 512):
        x = torch.randn(rows, k).to(torch.bfloat16)
        best = {}
        for _ in range(10):
            for name, start in (("vdpbf16ps", gemm_tiles.NEVER), ("fma", 1)):
                ops.set_gemm_fma_rows(start)
                t0 = time.perf_counter()
                ops.gemm(x, w)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        flops = 2 * rows * n * k
        print(f"{n}x{k} rows {rows:4d}: " + "  ".join(
            f"{name} {t * 1e3:7.3f} ms {flops / t / 1e9:5.0f} GFLOP/s" for name, t in best.items())
            + f"  fma/vdpbf16ps {best['fma'] / best['vdpbf16ps']:.2f}x")
ops.set_gemm_fma_rows(chosen)
