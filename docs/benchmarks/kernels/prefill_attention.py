"""The paged-attention kernel on one prefill chunk against SDPA (the layer path), SmolLM2 heads
(9 query, 3 KV, dim 64), bf16, two threads: n new tokens after c cached ones. SDPA here is the 3-D-heads
call with enable_gqa; the layer path expands K/V first, which is faster still.
Usage: python docs/benchmarks/kernels/prefill_attention.py
"""
import time
import torch
import torch.nn.functional as F
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
cpu_kernels.library(); ops.set_num_threads(2); torch.set_num_threads(2)
H, KV, D, BS = 9, 3, 64, 16
def t(f, n=20):
    f(); best = float("inf")
    for _ in range(n):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best * 1e3
for n, c in [(16,0),(64,0),(128,0),(256,0),(512,0),(128,512),(1024,0),(2048,0)]:
    L = c + n; nb = -(-L//BS)
    kc = torch.randn(nb+2, BS, KV, D).bfloat16(); vc = torch.randn(nb+2, BS, KV, D).bfloat16()
    table = torch.arange(nb)[None].contiguous(); lens = torch.tensor([L]); qsl = torch.tensor([0, n])
    q = torch.randn(n, H, D).bfloat16()
    k = kc.view(-1, KV, D)[:L]; v = vc.view(-1, KV, D)[:L]
    def sdpa():
        qq = q.transpose(0,1)[None]; kk = k.transpose(0,1)[None]; vv = v.transpose(0,1)[None]
        if c == 0:
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        mask = torch.arange(L)[None] <= torch.arange(c, L)[:, None]
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
    kern = lambda: ops.paged_attention(q, kc, vc, table, lens, qsl, D**-0.5, 0)
    a = kern().float(); b = sdpa()[0].transpose(0,1).reshape(n, -1).float()
    print(f"n={n} c={c}: kernel {t(kern):.3f} ms  sdpa {t(sdpa):.3f} ms  maxdiff {float((a-b).abs().max()):.4f}")
