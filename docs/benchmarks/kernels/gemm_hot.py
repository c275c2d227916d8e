"""Two builds of the kernels, A and B, on one weight that stays in cache (N x K, default 2048 x
1024): M rows through `pagoda_gemm_packed`, the builds alternating over 7 rounds (the first
dropped), each round repeating the call for ~0.3-2 G multiply-adds; GFLOP/s (bf16) or G
multiply-adds/s (int4, groups of 32; int8, per channel). What a tile computes with the weight stream out of the way.

Usage: python docs/benchmarks/kernels/gemm_hot.py LIB_A.so LIB_B.so M [M ...]
Env: KIND bf16|int4|int8 (bf16), N, K, T threads (1), FMA the row count from which bf16 steps take the
second tile kind (`pagoda_gemm_set_fma_rows`; default 8). A and B must be different files.
"""
import ctypes
import os
import statistics
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

cpu_kernels.library()
libs = [ctypes.CDLL(p) for p in sys.argv[1:3]]
L, P = ctypes.c_int64, ctypes.c_void_p
for lib in libs:
    lib.pagoda_gemm_packed.argtypes = [P, P, L, P, P, L, L]
    lib.pagoda_set_num_threads(int(os.environ.get("T", 1)))
    lib.pagoda_gemm_set_fma_rows(ctypes.c_int64(int(os.environ.get("FMA", 8))))
N, K, kind = int(os.environ.get("N", 2048)), int(os.environ.get("K", 1024)), os.environ.get("KIND", "bf16")
torch.manual_seed(0)
w = torch.randn(N, K) * 0.05
if kind == "int4":
    weight = ops.Int4Panels(*packing.unpack_int4(packing.quantize_int4(w, 32), K, 32), 32)
elif kind == "int8":
    weight = ops.Int8Panels(*packing.unpack_int8(packing.quantize_int8(w), K))
else:
    weight = ops.PackedWeight(w.to(torch.bfloat16))
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; {kind} {N} x {K}; load {open('/proc/loadavg').read().split()[:3]}")
for m in [int(a) for a in sys.argv[3:]]:
    x = torch.randn(m, K).to(torch.bfloat16)
    y = torch.empty(m, N, dtype=torch.bfloat16)
    reps = max(3, int(3e8 / (m * N * K)))
    times: list[list[float]] = [[], []]
    for _ in range(7):
        for j, lib in enumerate(libs):
            start = time.perf_counter()
            for _ in range(reps):
                lib.pagoda_gemm_packed(weight.desc_ptr, x.data_ptr(), K, None, y.data_ptr(), N, m)
            times[j].append((time.perf_counter() - start) / reps)
    a, b = (statistics.median(t[1:]) for t in times)
    per = (2 if kind == "bf16" else 1) * m * N * K / 1e9
    unit = "GFLOP/s" if kind == "bf16" else "G multiply-adds/s"
    print(f"M={m}: A {per / a:.1f}  B {per / b:.1f} {unit}  A/B {a / b:.2f}", flush=True)
