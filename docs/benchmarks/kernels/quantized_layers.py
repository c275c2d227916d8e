"""Each quantized linear of a loaded model at M rows, as the layer path runs it (`forward`,
medians of 6 calls after one), summed by kind: panels (which, which group size) or records.
What a decode step of M streams spends in its linears, and on which kernel.

Usage: python docs/benchmarks/kernels/quantized_layers.py [MODEL [QUANTIZATION [M]]]
(default: gemma3-270m gguf 16)
"""
import collections
import statistics
import sys
import time

import torch

from pagoda import LLM
from pagoda.layers.quantization.methods import PackedLinearMethod

model_name, quantization, rows = (sys.argv[1:] + ["gemma3-270m", "gguf", "16"][len(sys.argv) - 1:])[:3]
llm = LLM(model_name, quantization=quantization, kv_cache_memory="256MiB", max_model_len=1024)
model = llm.engine.core.runner.model  # the in-process core (not --core-process)
totals: dict[str, float] = collections.defaultdict(float)
counts: collections.Counter[str] = collections.Counter()
for name, module in model.named_modules():
    method = getattr(module, "method", None)
    if not isinstance(method, PackedLinearMethod) or "Embedding" in type(module).__name__:
        continue
    panels = method.panels
    kind = (f"panels {type(panels).__name__} group {panels.group_size or 'channel'}" if panels is not None
            else f"records {method.scheme} group {method.group_size}" + (" + offsets" if method.offsets is not None else ""))
    x = torch.randn(int(rows), method.in_features).to(torch.bfloat16)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        module(x)
        times.append(time.perf_counter() - start)
    key = f"{kind} [{name.rsplit('.', 1)[-1]}]"
    totals[key] += statistics.median(times[1:])
    counts[key] += 1
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
print(f"# {cpu}; {model_name} {quantization}, {rows} rows")
for key, total in sorted(totals.items(), key=lambda kv: -kv[1]):
    print(f"{total * 1e3:8.2f} ms  {counts[key]:3d}x  {key}")
print(f"{sum(totals.values()) * 1e3:8.2f} ms in all")
