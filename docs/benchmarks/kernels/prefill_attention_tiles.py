"""Prefill attention on its two tile kinds in one process: the four chunks of a 2,000-token prompt
at a 512-token budget (SmolLM2 heads, bf16, two threads), fp32 FMAs (`set_gemm_fma_rows(1)`) and
bf16 pairs (the choice where vdpbf16ps wins), alternating, best of 5 per chunk, ms a layer.
Usage: python docs/benchmarks/kernels/prefill_attention_tiles.py   (the avx512bf16 build has both kinds)
"""
import time

import torch
from prefill_chunks import PROMPT_CHUNKS, chunk_case

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library(); ops.set_num_threads(2); torch.set_num_threads(2)
NEVER = 1 << 62
cases = [chunk_case(n, c) for n, c in PROMPT_CHUNKS]
def t(f, n=5):
    f(); best = float("inf")
    for _ in range(n):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best * 1e3
for rnd in range(3):
    for name, rows, amx in [("fma", 1, NEVER), ("dpbf16", NEVER, NEVER), ("amx", NEVER, 1)]:
        ops.set_gemm_fma_rows(rows)
        if not ops.set_gemm_amx_rows(amx) and amx == 1: continue
        ts = [t(f) for f in cases]
        print(rnd, name, " ".join(f"{x:.2f}" for x in ts), f"sum {sum(ts):.2f} ms")
