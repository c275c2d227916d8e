"""Two prefill chunks through the paged-attention kernel on AMX tiles (SmolLM2's heads, bf16, two
threads): the last 464-token chunk of a 2,000-token prompt (after 1,536 cached keys) and a first
512-token chunk, each called 60 times after one warm-up: the fastest call and the first
quartile, in ms. For comparing kernel builds on a noisy host (run it from two checkouts,
alternating).
Usage: python docs/benchmarks/kernels/prefill_chunk_best.py   (a CPU with AMX)
"""
import sys
import time

import torch
from prefill_chunks import chunk_case

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library()
ops.set_num_threads(2)
torch.set_num_threads(2)
if not ops.set_gemm_amx_rows(1):
    sys.exit("no AMX tiles here (amx_bf16), or Linux refused the tile data")


def fastest_and_quartile(f, n: int = 60) -> tuple[float, float]:  # noqa: ANN001
    f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0] * 1e3, times[n // 4] * 1e3


(last, last_q1), (first, first_q1) = (fastest_and_quartile(chunk_case(n, c)) for n, c in [(464, 1536), (512, 0)])
print(f"last {last:.3f} q1 {last_q1:.3f}  first {first:.3f} q1 {first_q1:.3f}")
