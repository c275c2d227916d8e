"""How fast one row streams SmolLM2's bf16 weights: a flat read of 56 MB (`torch.amax`, two
threads) against the GEMM over the LM head (one 49152 x 576 call, 56 MB) and over the 30 layers'
120 distinct weights (212 MB), each packed weight on its own (4 KB pages) or all in one
huge-page buffer (`ops.gather_in_huge_pages`, as the engine keeps them). Medians of 15 passes,
interleaved, GB/s of weight read (Python's ~4 us a call included).
Usage: python docs/benchmarks/kernels/weight_stream.py        Env: KT kernel threads (2).
"""
import os, statistics, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
H, I, V = 576, 1536, 49152
torch.manual_seed(0)
flat = torch.randn(56 * 2**20 // 4)
head = [ops.PackedWeight((torch.randn(V, H) * 0.05).to(torch.bfloat16))]
layers = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for _ in range(30) for n, k in [(960, H), (H, H), (2 * I, H), (H, I)]]
small = [ops.PackedWeight(w) for w in layers]
huge = [ops.PackedWeight(w) for w in layers]
ops.gather_in_huge_pages(huge)
xs = {K: torch.randn(1, K).to(torch.bfloat16) for K in (H, I)}


def gemm(ws):
    return lambda: [ops.gemm(xs[w.k], w) for w in ws]


cases = {"flat read (torch.amax)": (lambda: flat.amax(), flat.numel() * 4),
         "GEMM, LM head": (gemm(head), V * H * 2),
         "GEMM, 30 layers, small pages": (gemm(small), sum(w.numel() * 2 for w in layers)),
         "GEMM, 30 layers, one huge-page buffer": (gemm(huge), sum(w.numel() * 2 for w in layers))}
times = {k: [] for k in cases}
for _ in range(15):
    for name, (fn, _) in cases.items():
        t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
print(f"# load {open('/proc/loadavg').read().split()[:3]}")
for name, (_, nbytes) in cases.items():
    t = statistics.median(times[name][1:])
    print(f"{name:40s} {t * 1e3:6.2f} ms  {nbytes / t / 1e9:5.1f} GB/s")
