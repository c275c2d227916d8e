"""The int8 GEMM over one SmolLM2 step's linears as the engine reads them (30 layers of distinct
weights, 106 MB of codes; the LM head left out: it is the same in every build), M input rows,
each kernel build's own panels: `avx512vbmi` (codes turned into bf16 by byte-table lookups)
against `avx512bf16` (int8 -> int32 -> fp32 -> bf16), the bf16 GEMM beside them; each set
gathered into one huge-page buffer, as the engine does. Medians of 9 passes (the first
dropped), the builds interleaved pass by pass.

Usage: python int8_gemm.py M [M ...]        Env: KT kernel threads (2).
"""
import os, statistics, sys, time
import torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

H, I = 576, 1536
shapes = [(960, H), (H, H), (2 * I, H), (H, I)]
torch.manual_seed(0)
codes = [[torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes] for _ in range(30)]
scales = [torch.rand(s[0]) * 0.01 for s in shapes]
builds = {}
for variant in ("avx512vbmi", "avx512bf16"):
    cpu_kernels.use_variant(variant)
    builds[variant] = [[ops.Int8Panels(c, scales[j]) for j, c in enumerate(cs)] for cs in codes]
builds["bf16 (avx512vbmi)"] = [[ops.PackedWeight((c.float() * 0.01).to(torch.bfloat16)) for c in cs] for cs in codes]
for weights in builds.values():
    ops.gather_in_huge_pages([w for ws in weights for w in ws])


def run(M, kind):
    cpu_kernels.use_variant("avx512bf16" if kind == "avx512bf16" else "avx512vbmi")
    ops.set_num_threads(int(os.environ.get("KT", 2)))
    xs = {K: torch.randn(M, K).to(torch.bfloat16) for K in (H, I)}
    t = time.perf_counter()
    for ws in builds[kind]:
        for w in ws:
            ops.gemm(xs[w.k], w)
    return time.perf_counter() - t


print(f"# load {open('/proc/loadavg').read().split()[:3]} KT={os.environ.get('KT', 2)}")
for M in [int(m) for m in sys.argv[1:]] or [1]:
    res = {k: [] for k in builds}
    for rep in range(9):
        for k in res:
            res[k].append(run(M, k))
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    print(f"M={M:4d} " + "  ".join(f"{k} {v * 1e3:6.2f} ms" for k, v in med.items()))
