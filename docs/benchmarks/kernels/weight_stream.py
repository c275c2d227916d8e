"""How fast one row streams SmolLM2's bf16 weights: a flat read of 56 MB (`torch.amax`, two
threads) against the GEMM over the LM head (one 49152 x 576 call, 56 MB) and over the 30 layers'
120 distinct weights (212 MB), each packed weight on its own (4 KB pages) or all in one
huge-page buffer (`ops.gather_in_huge_pages`, as the engine keeps them). Medians of 15 passes,
interleaved, GB/s of weight read (Python's ~4 us a call included).
`--shape 1b`: Llama-3.2-1B's linears instead (16 layers, hidden 2048, MLP 8192, 1.97 GB, and a
49152 x 2048 head, 0.2 GB), all in one huge-page buffer, against a flat read of 2 GB: the decode
step of `pagoda bench`'s 1B shape, far larger than any cache.
Usage: python docs/benchmarks/kernels/weight_stream.py [--shape 1b]        Env: KT kernel threads (2).
"""
import os, statistics, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
ONE_B = sys.argv[1:] == ["--shape", "1b"]
H, I, V, L, QKV = (2048, 8192, 49152, 16, 3072) if ONE_B else (576, 1536, 49152, 30, 960)
torch.manual_seed(0)
flat = torch.randn((2048 if ONE_B else 56) * 2**20 // 4)


def weight(n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k) * 0.05).to(torch.bfloat16)


head = [ops.PackedWeight(weight(V, H))]
shapes = [(QKV, H), (H, H), (2 * I, H), (H, I)]
layers = [] if ONE_B else [weight(n, k) for _ in range(L) for n, k in shapes]
small = [ops.PackedWeight(w) for w in layers]
huge = [ops.PackedWeight(weight(n, k)) for _ in range(L) for n, k in shapes] if ONE_B else [ops.PackedWeight(w) for w in layers]
ops.gather_in_huge_pages(huge + head if ONE_B else huge)
huge_bytes = sum(w.n * w.k * 2 for w in huge)
xs = {K: torch.randn(1, K).to(torch.bfloat16) for K in (H, I)}


def gemm(ws):
    return lambda: [ops.gemm(xs[w.k], w) for w in ws]


cases = {"flat read (torch.amax)": (lambda: flat.amax(), flat.numel() * 4),
         "GEMM, LM head": (gemm(head), V * H * 2),
         f"GEMM, {L} layers, one huge-page buffer": (gemm(huge), huge_bytes)}
if not ONE_B:
    cases["GEMM, 30 layers, small pages"] = (gemm(small), sum(w.numel() * 2 for w in layers))
else:
    cases["GEMM, a whole step (layers + head)"] = (gemm(huge + head), huge_bytes + V * H * 2)
times = {k: [] for k in cases}
for _ in range(15):
    for name, (fn, _) in cases.items():
        t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
print(f"# load {open('/proc/loadavg').read().split()[:3]}")
for name, (_, nbytes) in cases.items():
    t = statistics.median(times[name][1:])
    print(f"{name:40s} {t * 1e3:6.2f} ms  {nbytes / t / 1e9:5.1f} GB/s")
