"""Prefill attention on its two tile kinds in one process: the four chunks of a 2,000-token prompt
at a 512-token budget (SmolLM2 heads, bf16, two threads), fp32 FMAs (`set_gemm_fma_rows(1)`) and
bf16 pairs (the choice where vdpbf16ps wins), alternating, best of 5 per chunk, ms a layer.
Usage: python docs/benchmarks/kernels/prefill_attention_tiles.py   (the avx512bf16 build has both kinds)
"""
import time, torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
cpu_kernels.library(); ops.set_num_threads(2); torch.set_num_threads(2)
H, KV, D, BS = 9, 3, 64, 16
NEVER = 1 << 62
cases = []
for n, c in [(512,0),(512,512),(512,1024),(464,1536)]:
    L = c + n; nb = -(-L//BS)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(nb+2, BS, KV, D, generator=g).bfloat16(); vc = torch.randn(nb+2, BS, KV, D, generator=g).bfloat16()
    table = torch.arange(nb)[None].contiguous(); lens = torch.tensor([L]); qsl = torch.tensor([0, n])
    q = torch.randn(n, H, D, generator=g).bfloat16()
    cases.append(lambda q=q,kc=kc,vc=vc,table=table,lens=lens,qsl=qsl: ops.paged_attention(q, kc, vc, table, lens, qsl, D**-0.5, 0))
def t(f, n=5):
    f(); best = float("inf")
    for _ in range(n):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best * 1e3
for rnd in range(3):
    for name, rows, amx in [("fma", 1, NEVER), ("dpbf16", NEVER, NEVER), ("amx", NEVER, 1)]:
        ops.set_gemm_fma_rows(rows)
        if not ops.set_gemm_amx_rows(amx) and amx == 1: continue
        ts = [t(f) for f in cases]
        print(rnd, name, " ".join(f"{x:.2f}" for x in ts), f"sum {sum(ts):.2f} ms")
