"""A decode step's linears streamed from memory at a few rows, on each kind of tile this CPU has
for bf16 panels: AMX tiles (where the CPU has them), the vector tiles without a software
prefetch, and the vector tiles prefetching (`ops.set_gemm_prefetch_rows(1)`): what the load-time
stream probe (cpu_kernels/gemm_tiles.py, `decide_stream`) chooses between. SmolLM2's 30 layers +
LM head (269 MB) or, with --1b, Llama-3.2-1B's 16 layers + head (2.2 GB), all in one huge-page
buffer; the kinds interleaved pass by pass, medians of N-1 passes (N=10).
Usage: python docs/benchmarks/kernels/stream_tiles.py [--1b] [ROWS ...]      Env: N, KT (2).
"""
import os, statistics, sys, time
import torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
args = [a for a in sys.argv[1:] if a != "--1b"]
ONE_B = "--1b" in sys.argv[1:]
H, I, V, L, QKV = (2048, 8192, 49152, 16, 3072) if ONE_B else (576, 1536, 49152, 30, 960)
torch.manual_seed(0)
ws = [ops.PackedWeight((torch.randn(n, k) * 0.05).to(torch.bfloat16))
      for _ in range(L) for n, k in [(QKV, H), (H, H), (2 * I, H), (H, I)]]
ws.append(ops.PackedWeight((torch.randn(V, H) * 0.05).to(torch.bfloat16)))
ops.gather_in_huge_pages(ws)
nbytes = sum(w.n * w.k * 2 for w in ws)
amx_rows, prefetch_rows = ops.GEMM_AMX_ROWS, ops.GEMM_PREFETCH_ROWS
has_amx = ops.set_gemm_amx_rows(1)
kinds = ({"AMX tiles": (1, ops.DEFAULT_PREFETCH_ROWS)} if has_amx else {}) | {
    "vector tiles": (1 << 62, ops.DEFAULT_PREFETCH_ROWS), "vector tiles, prefetching": (1 << 62, 1)}
print(f"{'1B shape' if ONE_B else 'SmolLM2'}: {nbytes / 1e6:.0f} MB; the load-time choice: AMX from {amx_rows} rows, "
      f"one tile prefetching from {prefetch_rows}")
for rows in [int(a) for a in args] or [1, 4]:
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (H, I)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(int(os.environ.get("N", 10))):
        for name, (amx, pf) in kinds.items():
            if has_amx:
                ops.set_gemm_amx_rows(amx)
            ops.set_gemm_prefetch_rows(pf)
            t = time.perf_counter(); [ops.gemm(xs[w.k], w) for w in ws]; times[name].append(time.perf_counter() - t)
    for name, v in times.items():
        m = statistics.median(v[1:])
        print(f"  rows {rows:3d}  {name:26s} {m * 1e3:7.1f} ms  {nbytes / m / 1e9:5.1f} GB/s")
if has_amx:
    ops.set_gemm_amx_rows(amx_rows)
ops.set_gemm_prefetch_rows(prefetch_rows)
