"""int5 panels (GGUF's Q5_0, `ops.Int4Panels` of codes in [0, 31]) against the int8 panels of the
same codes (q - 16, f16 scales by groups of 32), SmolLM2's Q5_0-shaped layers (gate/up 3072 x
576, o 576 x 576, qkv 960 x 576), 30 of each, distinct random weights, best of 7 a row count,
each kind twice in turn. `vpdpbusd` (the default) turns the AMX integer tiles off, as on a CPU
without AMX (Zen 4); `amx` leaves the measured choice.
Usage: python docs/benchmarks/kernels/int5_panels.py [vpdpbusd|amx] [ROWS...]
"""
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library()
ops.set_num_threads(2)
mode = sys.argv[1] if len(sys.argv) > 1 else "vpdpbusd"
rows = [int(r) for r in sys.argv[2:]] or [1, 4, 8, 16, 32, 64]
if mode == "vpdpbusd":
    ops.set_gemm_amx_integer_rows(4, 1 << 62)
    ops.set_gemm_amx_integer_rows(8, 1 << 62)
gen = torch.Generator().manual_seed(1)
five, eight = [], []
for _ in range(30):
    for n, k in [(3072, 576), (576, 576), (960, 576)]:
        q = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.uint8)
        d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
        five.append(ops.Int4Panels(q, d, -16 * d, 32))
        eight.append(ops.Int8Panels((q.to(torch.int16) - 16).to(torch.int8), d.float()))


def ms(weights: list, m: int) -> float:
    x = torch.randn(m, 576).to(torch.bfloat16)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for w in weights:
            ops.gemm(x, w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


print(f"{mode}: rows, int5 ms, int8 ms, int8 / int5")
for m in rows:
    a, b, c, d = ms(five, m), ms(eight, m), ms(five, m), ms(eight, m)
    print(f"{m:4d}  {a:.2f} / {c:.2f}  {b:.2f} / {d:.2f}  {min(b, d) / min(a, c):.2f}x")
