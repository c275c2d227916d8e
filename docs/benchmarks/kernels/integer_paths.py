"""Quantized layers two ways on this build's kernels, as `PackedLinearMethod` runs them: on
their records (the GEMV up to `INTEGER_GEMV_MAX_ROWS` rows on AVX2, else a dequantized copy)
and on the GEMM's panels (`use_gemm`), over SmolLM2's linears (30 layers of distinct weights;
SHAPE=1b: the Llama-3.2-1B shape's 16 layers; LMHEAD=1 adds SmolLM2's 49,152 x 576 output layer
once), M rows, the two alternating pass by pass over PASSES passes (the first dropped): medians,
ms a pass and GB/s of weights read.

Usage: python docs/benchmarks/kernels/integer_paths.py [M ...]
Env: KIND int4 (groups of 32), int8 (per channel) or q8_0 (int8 by groups of 32 with f16 scales,
as GGUF's Q8_0; default int4), SHAPE, LMHEAD, PASSES (11), KT threads (2).
"""
import os
import statistics
import sys
import time

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing
from pagoda.layers.quantization.methods import PackedLinearMethod

cpu_kernels.library()
ops.set_num_threads(int(os.environ.get("KT", 2)))
KIND = os.environ.get("KIND", "int4")
H, QKV, INTER, LAYERS = (2048, 3072, 8192, 16) if os.environ.get("SHAPE") == "1b" else (576, 960, 1536, 30)
shapes = [(QKV, H), (H, H), (2 * INTER, H), (H, INTER)] * LAYERS + ([(49152, 576)] if os.environ.get("LMHEAD") else [])
torch.manual_seed(0)


def method(n: int, k: int) -> PackedLinearMethod:
    w = torch.randn(n, k) * 0.05
    if KIND == "int4":
        return PackedLinearMethod("int4", packing.quantize_int4(w, 32), k, 32)
    if KIND == "q8_0":
        d = (w.view(n, -1, 32).abs().amax(-1) / 127).half().float()
        q = torch.round(w.view(n, -1, 32) / d[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
        return PackedLinearMethod("int8", packing.pack_int8(q, d), k, 32)
    return PackedLinearMethod("int8", packing.quantize_int8(w), k, k)


records = [(method(n, k), k) for n, k in shapes]
panels = [(method(n, k), k) for n, k in shapes]
if not all(m.use_gemm() for m, _ in panels):
    sys.exit(f"this build ({cpu_kernels.library().variant}) keeps {KIND} records: no panels to compare")
gb = sum(m.weight_bytes() for m, _ in records) / 1e9
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; kernels {cpu_kernels.library().variant}; {KIND}; load {open('/proc/loadavg').read().split()[:3]}")
for m in [int(a) for a in sys.argv[1:]] or [1]:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in shapes}

    def run(layers: list, xs: dict = xs) -> float:
        start = time.perf_counter()
        for layer, k in layers:
            layer.apply(None, xs[k], None)
        return time.perf_counter() - start

    times: list[list[float]] = [[], []]
    for _ in range(int(os.environ.get("PASSES", 11))):
        for j, layers in enumerate((records, panels)):
            times[j].append(run(layers))
    r, p = (statistics.median(t[1:]) for t in times)
    print(f"M={m}: records {r * 1e3:.2f} ms ({gb / r:.1f} GB/s)  panels {p * 1e3:.2f} ms ({gb / p:.1f} GB/s)  "
          f"records/panels {r / p:.2f}", flush=True)
