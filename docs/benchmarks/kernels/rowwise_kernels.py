"""The row-wise kernels of a 512-token prefill chunk of SmolLM2 (bf16, two threads): SiLU-and-mul
over [512, 2 x 1536], the fused residual add and RMSNorm over [512, 576], and rotary over the
chunk's 12 q/k heads of 64 (inside the fused qkv rows). Best of 30 calls each, in ms.
Run it from two checkouts (PYTHONPATH=that checkout, its kernels built), alternating, to
compare commits.
Usage: python docs/benchmarks/kernels/rowwise_kernels.py [LABEL]
"""
import sys

import torch
from best_time import best

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library()
ops.set_num_threads(2)
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
rows, hidden, inter, heads, kv_heads, d = 512, 576, 1536, 9, 3, 64


gate_up = torch.randn(rows, 2 * inter, generator=gen).to(torch.bfloat16)
x, residual = (torch.randn(rows, hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
weight = torch.rand(hidden, generator=gen).to(torch.bfloat16)
qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(torch.bfloat16)
qk = qkv[:, :(heads + kv_heads) * d].view(rows, heads + kv_heads, d)
positions = torch.arange(rows) + 1000
inv_freq = 1.0 / (100000 ** (torch.arange(0, d, 2).float() / d))
angles = torch.outer(torch.arange(4096).float(), inv_freq)
cos, sin = torch.cat([angles.cos()] * 2, -1).contiguous(), torch.cat([angles.sin()] * 2, -1).contiguous()
label = sys.argv[1] if len(sys.argv) > 1 else ""
print(f"{label:6s} silu_and_mul {best(lambda: ops.silu_and_mul(gate_up), n=30) * 1e3:.3f} ms  "
      f"fused_add_rms_norm {best(lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-5), n=30) * 1e3:.3f} ms  "
      f"rotary {best(lambda: ops.rotary_inplace(qk, positions, cos, sin), n=30) * 1e3:.3f} ms")
