"""int8 and int4 panels on vpdpbusd against AMX tiles (the weight widened to bf16 a panel at a
time), beside bf16 panels on AMX: SmolLM2's 30 layers of linears (fused QKV, O, fused
gate/up, down; distinct random weights, no LM head; int8 106 MB, int4 group 32 ~60 MB, bf16 212
MB: from memory), ROWS rows: the median of PASSES passes per kind, kinds alternating pass by
pass. Two kernel threads.
Usage: python docs/benchmarks/kernels/integer_amx.py [PASSES] ROWS...   (a CPU with AMX)
"""
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
args = [int(a) for a in sys.argv[1:]]
passes, counts = (args[0], args[1:]) if len(args) > 1 else (7, args or [16, 64, 256])
hidden, inter = 576, 1536
shapes = [(960, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
gen = torch.Generator().manual_seed(0)


def int4(n: int, k: int) -> ops.Int4Panels:
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).to(torch.float16)
    return ops.Int4Panels(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, -8 * d, 32)


weights = {
    "int8": [ops.Int8Panels(torch.randint(-127, 128, s, generator=gen, dtype=torch.int8), torch.rand(s[0]) * 0.01)
             for _ in range(30) for s in shapes],
    "int4": [int4(*s) for _ in range(30) for s in shapes],
    "bf16": [ops.PackedWeight((torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16)) for _ in range(30) for s in shapes],
}
# (label, weights, int8 AMX from, int4 AMX from)
kinds = [("int8 vpdpbusd", "int8", 1 << 62, 1 << 62), ("int8 AMX", "int8", 1, 1 << 62),
         ("int4 vpdpbusd", "int4", 1 << 62, 1 << 62), ("int4 AMX", "int4", 1 << 62, 1), ("bf16 AMX", "bf16", 1, 1)]
print(f"{cpu_kernels.loader.cpu_model()}; median ms of {passes} passes over the 30 layers")
for rows in counts:
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (hidden, inter)}
    times: dict[str, list[float]] = {label: [] for label, *_ in kinds}
    for _ in range(passes + 1):
        for label, kind, int8_from, int4_from in kinds:
            ops.set_gemm_amx_integer_rows(8, int8_from)
            ops.set_gemm_amx_integer_rows(4, int4_from)
            start = time.perf_counter()
            for w in weights[kind]:
                ops.gemm(xs[w.k], w)
            times[label].append(time.perf_counter() - start)
    print(f"{rows:4d} rows: " + "  ".join(f"{label} {statistics.median(t[1:]) * 1e3:6.1f}" for label, t in times.items()))
