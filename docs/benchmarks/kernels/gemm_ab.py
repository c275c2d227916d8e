"""Two builds of the kernels, A and B, on SmolLM2's linears (30 layers of distinct weights
in the GEMM's panels, 212 MB in bf16), M rows through `pagoda_gemm_packed`, the builds alternating
pass by pass over 15 passes (the first dropped): an A/B of the GEMM that holds on a noisy
machine.

Usage: python gemm_ab.py LIB_A.so LIB_B.so M [M ...]
Env: KIND bf16 (default), int8 (per channel) or int4 (groups of 32): the same layers quantized;
SHAPE=1b the Llama-3.2-1B shape's 16 layers instead (2.1 GB); FMA_ROWS_A / FMA_ROWS_B the row
count from which each build takes its second tile kind (`pagoda_gemm_set_fma_rows`: the AVX-512
build's FMA tiles, the AVX2 build's widened chunks; default: never); PASSES (15).
A and B must be different files (one file loads once: copy it to compare a build with itself).
Build A from another checkout (a git worktree: `python -m pagoda.layers.cpu_kernels` there);
copy a .so away before rebuilding, since a build replaces its variant's older files.
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
H, QKV, INTER, LAYERS = (2048, 3072, 8192, 16) if os.environ.get("SHAPE") == "1b" else (576, 960, 1536, 30)
shapes = [(QKV, H), (H, H), (2 * INTER, H), (H, INTER)]
torch.manual_seed(0)
KIND = os.environ.get("KIND", "bf16")


def packed(n: int, k: int) -> ops.PackedWeight | ops.Int8Panels | ops.Int4Panels:
    w = torch.randn(n, k) * 0.05
    if KIND == "int8":
        return ops.Int8Panels(*packing.unpack_int8(packing.quantize_int8(w), k))
    if KIND == "int4":
        return ops.Int4Panels(*packing.unpack_int4(packing.quantize_int4(w, 32), k, 32), 32)
    return ops.PackedWeight(w.to(torch.bfloat16))


weights = [packed(n, k) for _ in range(LAYERS) for n, k in shapes]
L, P = ctypes.c_int64, ctypes.c_void_p
for lib in libs:
    lib.pagoda_gemm_packed.argtypes = [P, P, L, P, P, L, L]
    lib.pagoda_set_num_threads.argtypes = [ctypes.c_int]
    lib.pagoda_set_num_threads(2)
for lib, env in zip(libs, ("FMA_ROWS_A", "FMA_ROWS_B"), strict=True):
    if os.environ.get(env):
        lib.pagoda_gemm_set_fma_rows(ctypes.c_int64(int(os.environ[env])))
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; load {open('/proc/loadavg').read().split()[:3]}")
for m in [int(a) for a in sys.argv[3:]] or [16]:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (H, INTER)}
    ys = {n: torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes}

    def one_pass(lib: ctypes.CDLL, m: int = m, xs: dict = xs, ys: dict = ys) -> float:
        start = time.perf_counter()
        for w in weights:
            lib.pagoda_gemm_packed(w.desc_ptr, xs[w.k].data_ptr(), w.k, None, ys[w.n].data_ptr(), w.n, m)
        return time.perf_counter() - start

    times: list[list[float]] = [[], []]
    for _ in range(int(os.environ.get("PASSES", 15))):
        for j, lib in enumerate(libs):
            times[j].append(one_pass(lib))
    a, b = (statistics.median(t[1:]) for t in times)
    print(f"M={m}: A {a * 1e3:.2f} ms  B {b * 1e3:.2f} ms  A/B {a / b:.2f}", flush=True)
