"""Two builds of the kernels, A and B, on SmolLM2's quantized linears (30 layers of distinct
weights as int4 records, groups of 32, or int8 records per channel), M rows through
`pagoda_qgemv_bf16`, the builds alternating call by call over 21 passes (the first dropped):
an A/B of the quantized GEMV that holds on a noisy machine.

Usage: python qgemv_ab.py LIB_A.so LIB_B.so [int4|int8] [M]    Env: KT kernel threads (2).
Build A from another checkout (a git worktree: `python -m pagoda.layers.cpu_kernels` there);
copy a .so away before rebuilding, since a build replaces its variant's older files.
"""
import ctypes
import os
import statistics
import sys
import time

import torch

from pagoda.layers.quantization import packing

libs = [ctypes.CDLL(p) for p in sys.argv[1:3]]
scheme = sys.argv[3] if len(sys.argv) > 3 else "int4"
M = int(sys.argv[4]) if len(sys.argv) > 4 else 1
H, INTER = 576, 1536
shapes = [(960, H), (H, H), (2 * INTER, H), (H, INTER)]
torch.manual_seed(0)
records = []
for _ in range(30):
    for n, k in shapes:
        w = torch.randn(n, k) * 0.05
        records.append((packing.quantize_int4(w, 32) if scheme == "int4" else packing.quantize_int8(w, None), n, k))
fmt = 0 if scheme == "int4" else 1
xs = {k: torch.randn(M, k).to(torch.bfloat16) for k in (H, INTER)}
ys = {n: torch.empty(M, n, dtype=torch.bfloat16) for n, _ in shapes}
L, P = ctypes.c_int64, ctypes.c_void_p
for lib in libs:
    lib.pagoda_qgemv_bf16.argtypes = [ctypes.c_int, P, L, P, L, L, P, P, L, L, L, L, ctypes.c_int]
    lib.pagoda_set_num_threads.argtypes = [ctypes.c_int]
    lib.pagoda_set_num_threads(int(os.environ.get("KT", 2)))


def one_pass(lib: ctypes.CDLL) -> float:
    start = time.perf_counter()
    for rec, n, k in records:
        gs = 32 if scheme == "int4" else k
        lib.pagoda_qgemv_bf16(fmt, xs[k].data_ptr(), k, rec.data_ptr(), rec.shape[1], gs, None, ys[n].data_ptr(), n,
                              M, n, k, 1 << 30)
    return time.perf_counter() - start


times: list[list[float]] = [[], []]
for _ in range(21):
    for j, lib in enumerate(libs):
        times[j].append(one_pass(lib))
a, b = (statistics.median(t[1:]) for t in times)
mb = sum(rec.numel() for rec, _, _ in records) / 1e6
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; load {open('/proc/loadavg').read().split()[:3]}")
print(f"{scheme} M={M}: A {a * 1e3:.2f} ms ({mb / a / 1e3:.1f} GB/s)  B {b * 1e3:.2f} ms ({mb / b / 1e3:.1f} GB/s)  "
      f"A/B {a / b:.2f}  ({mb:.0f} MB of records)")
