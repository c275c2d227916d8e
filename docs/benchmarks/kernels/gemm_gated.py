"""A gated MLP's gate/up product on the packed GEMM, SmolLM2's shape at a 512-row prefill step
(512 x 576 x 3072, bf16 panels, two threads), best of 20: the product alone, the product then
the elementwise SiLU-and-mul, and the product with the SiLU in its epilogue (`ops.gemm_gated`,
AMX tiles only: "n/a" elsewhere). Run it from two checkouts to compare commits.
Usage: python docs/benchmarks/kernels/gemm_gated.py [LABEL]
"""
import sys

import torch
from best_time import best

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library()
ops.set_num_threads(2)


gen = torch.Generator().manual_seed(0)
w = ops.PackedWeight((torch.randn(3072, 576, generator=gen) * 0.05).to(torch.bfloat16))
x = torch.randn(512, 576, generator=gen).to(torch.bfloat16)
plain = best(lambda: ops.gemm(x, w), n=20)
then = best(lambda: ops.silu_and_mul(ops.gemm(x, w)), n=20)
fused = best(lambda: ops.gemm_gated(x, w, "silu"), n=20) if getattr(ops, "gemm_gated", None) and ops.gemm_gated(x, w, "silu") is not None else None
print(sys.argv[1] if len(sys.argv) > 1 else "", f"product {plain * 1e3:.3f} ms ({2 * 512 * 576 * 3072 / plain / 1e9:.0f} GFLOP/s)",
      f"product + silu_and_mul {then * 1e3:.3f} ms", f"gated {fused * 1e3:.3f} ms" if fused else "gated n/a", sep="  ")
