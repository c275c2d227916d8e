"""SmolLM2's 30 layers of linears (fused QKV, O, fused gate/up, down; distinct random bf16 weights,
212 MB; no LM head) on the own GEMM with AMX tiles at every row count, M rows: the median of
the passes in SECONDS (default 10) after one warm-up. Two kernel threads.
Env (the defaults are SmolLM2's): HIDDEN (576), INTER (1536), QKV (the fused QKV's rows, 960),
LAYERS (30); DISTINCT (LAYERS) distinct layers' weights cycled over the LAYERS (DISTINCT=1: one
layer's weights, in cache, against the stream of all of them). Llama-3.2-1B's layer shape:
HIDDEN=2048 INTER=8192 QKV=3072.
Usage: python docs/benchmarks/kernels/gemm_layers.py M [SECONDS]   (a CPU with AMX)
"""
import os
import statistics
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library()
ops.set_num_threads(2)
torch.set_num_threads(2)
if not ops.set_gemm_amx_rows(1):
    sys.exit("no AMX tiles here (amx_bf16), or Linux refused the tile data")
M = int(sys.argv[1])
hidden, inter = int(os.environ.get("HIDDEN", 576)), int(os.environ.get("INTER", 1536))
num_layers = int(os.environ.get("LAYERS", 30))
distinct = int(os.environ.get("DISTINCT", num_layers))
shapes = [(int(os.environ.get("QKV", 960)), hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
torch.manual_seed(0)
layers = [[ops.PackedWeight((torch.randn(N, K) * 0.05).to(torch.bfloat16)) for N, K in shapes]
          for _ in range(distinct)]
xs = {K: torch.randn(M, K).bfloat16() for K in (hidden, inter)}


def one_pass() -> None:
    for i in range(num_layers):
        ws = layers[i % distinct]
        for w, (_, K) in zip(ws, shapes, strict=True):
            ops.gemm(xs[K], w)


one_pass()
times, t0 = [], time.time()
while time.time() - t0 < float(sys.argv[2] if len(sys.argv) > 2 else 10):
    s = time.perf_counter()
    one_pass()
    times.append(time.perf_counter() - s)
flops = 2 * M * sum(N * K for N, K in shapes) * num_layers
med = statistics.median(times)
print(f"M={M}: median {med * 1e3:.1f} ms ({flops / med / 1e9:.0f} GFLOP/s), min {min(times) * 1e3:.1f} ms, {len(times)} passes")
