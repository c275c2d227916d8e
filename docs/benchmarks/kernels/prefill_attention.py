"""The paged-attention kernel on one prefill chunk against SDPA (the torch path), SmolLM2 heads
(9 query, 3 KV, dim 64), bf16, two threads: n new tokens after c cached ones, best of 20. SDPA here is
the 3-D-heads call with enable_gqa; the torch path expands K/V first (`sdpa expanded`). `err` is the
mean absolute error against SDPA in fp64 on the same bf16 inputs (bf16 rounding alone: `ideal`).
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
    def sdpa(dtype=torch.bfloat16, expand=False):
        qq, kk, vv = (x.to(dtype).transpose(0, 1)[None] for x in (q, k, v))
        if expand:
            kk, vv = kk.repeat_interleave(H // KV, 1), vv.repeat_interleave(H // KV, 1)
        if c == 0:  # NOTE: as the torch path calls it: is_causal, no mask tensor
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=not expand)
        mask = torch.arange(L)[None] <= torch.arange(c, L)[:, None]
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=not expand)
    kern = lambda: ops.paged_attention(q, kc, vc, table, lens, qsl, D**-0.5, 0)
    flat = lambda o: o[0].transpose(0, 1).reshape(n, -1).float()
    ref = flat(sdpa(torch.float64))
    err = lambda o: float((o.float() - ref).abs().mean())
    print(f"n={n} c={c}: kernel {t(kern):.3f} ms  sdpa {t(sdpa):.3f} ms  "
          f"sdpa expanded {t(lambda: sdpa(expand=True)):.3f} ms  err kernel {err(kern()):.2e} "
          f"sdpa {err(flat(sdpa())):.2e} ideal {err(ref.bfloat16()):.2e}")
