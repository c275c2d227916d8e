"""int4 layers two ways on this build's kernels: the records' GEMV (`ops.qgemv`, one record a row)
and the GEMM's int4 panels (`ops.gemm` on `Int4Panels`), over SmolLM2's linears (30 layers of
distinct weights, groups of 32; SHAPE=1b: the Llama-3.2-1B shape's 16 layers), M rows, the two
alternating pass by pass over PASSES passes (the first dropped): medians, ms a pass and GB/s of
weights read.

Usage: python docs/benchmarks/kernels/int4_paths.py [M ...]     Env: SHAPE, PASSES (11), KT threads (2).
"""
import os
import statistics
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

cpu_kernels.library()
ops.set_num_threads(int(os.environ.get("KT", 2)))
H, QKV, INTER, LAYERS = (2048, 3072, 8192, 16) if os.environ.get("SHAPE") == "1b" else (576, 960, 1536, 30)
shapes = [(QKV, H), (H, H), (2 * INTER, H), (H, INTER)]
torch.manual_seed(0)
records, panels = [], []
for _ in range(LAYERS):
    for n, k in shapes:
        rec = packing.quantize_int4(torch.randn(n, k) * 0.05, 32)
        records.append((rec, k))
        panels.append(ops.Int4Panels(*packing.unpack_int4(rec, k, 32), 32))
gb = sum(rec.numel() for rec, _ in records) / 1e9
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; kernels {cpu_kernels.library().variant}; load {open('/proc/loadavg').read().split()[:3]}")
for m in [int(a) for a in sys.argv[1:]] or [1]:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (H, INTER)}

    def by_records(xs: dict = xs) -> float:
        start = time.perf_counter()
        for rec, k in records:
            ops.qgemv(xs[k], rec, ops.INT4, k, 32)
        return time.perf_counter() - start

    def by_panels(xs: dict = xs) -> float:
        start = time.perf_counter()
        for w in panels:
            ops.gemm(xs[w.k], w)
        return time.perf_counter() - start

    times: list[list[float]] = [[], []]
    for _ in range(int(os.environ.get("PASSES", 11))):
        for j, run in enumerate((by_records, by_panels)):
            times[j].append(run())
    r, p = (statistics.median(t[1:]) for t in times)
    print(f"M={m}: records {r * 1e3:.2f} ms ({gb / r:.1f} GB/s)  panels {p * 1e3:.2f} ms ({gb / p:.1f} GB/s)  "
          f"records/panels {r / p:.2f}", flush=True)
