"""The last 464-token chunk of a 2,000-token prompt (SmolLM2's heads, bf16, two threads) through
the paged-attention kernel on AMX tiles, in a loop for SECONDS (default 8): a target for
`perf record` (docs/performance.md, "A fifth CPU").
Usage: perf record -- python docs/benchmarks/kernels/prefill_chunk_loop.py [SECONDS]
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
attend = chunk_case(464, 1536)
t0 = time.time()
while time.time() - t0 < float(sys.argv[1] if len(sys.argv) > 1 else 8):
    attend()
