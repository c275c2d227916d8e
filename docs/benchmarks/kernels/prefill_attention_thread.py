"""Prefill attention of the four chunks of a 2,000-token prompt at a 512-token budget (SmolLM2's
heads, bf16, AMX tiles), on ONE thread: the sum over the chunks, wall and process CPU ms, best of 7.
One thread, so that the other vCPU's neighbours on a shared host move it less than the two-thread
figure of prefill_attention_tiles.py. Run it from two checkouts alternating to compare commits.
Usage: python docs/benchmarks/kernels/prefill_attention_thread.py [LABEL]
"""
import sys
import time

import torch
from prefill_chunks import PROMPT_CHUNKS, chunk_case

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library()
ops.set_num_threads(1)
torch.set_num_threads(1)
if not ops.set_gemm_amx_rows(1):
    sys.exit("no AMX tiles here (amx_bf16), or Linux refused the tile data")
cases = [chunk_case(n, c) for n, c in PROMPT_CHUNKS]


def run() -> None:
    for f in cases:
        f()


run()
wall = cpu = float("inf")
for _ in range(7):
    w, c = time.perf_counter(), time.process_time()
    run()
    wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} wall {wall * 1e3:.2f} cpu {cpu * 1e3:.2f} ms")
