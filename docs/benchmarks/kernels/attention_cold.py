"""Decode attention as in a real step: 30 layers' pools (cold in cache), B sequences x L tokens.

Env: KT kernel threads (2), B (64), L (250), N repetitions (10); OLD=1 times a previous
kernel built as OLD_SO (paged_decode_bf16 of commit 8dcdc2d) instead; HUGE=1 puts the pools
in huge pages; WARM=1 reuses one pool for every layer (K/V in cache). Prints ms per 30 layers and per layer, and the K/V bytes read per second.
"""
import os, time, statistics
import torch
torch.set_num_threads(1)
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
H, KV, D, BS = 9, 3, 64, 16
B, L = int(os.environ.get("B", 64)), int(os.environ.get("L", 250))
mb = (L + BS - 1)//BS; nb = B * mb + 4
pools = [(torch.randn(nb, BS, KV, D).to(torch.bfloat16), torch.randn(nb, BS, KV, D).to(torch.bfloat16)) for _ in range(1 if os.environ.get("WARM") else 30)]
pools = pools * (30 // len(pools))  # WARM=1: one pool for all 30 layers, K/V in cache
if os.environ.get("HUGE"):
    from huge_pages import move_to_huge_pages
    flat = move_to_huge_pages([t for p in pools for t in p]); pools = [(flat[2*i], flat[2*i+1]) for i in range(30)]
tables = torch.randperm(nb)[:B*mb].view(B, mb).contiguous()
lens = torch.full((B,), L, dtype=torch.long); q = torch.randn(B, H, D).to(torch.bfloat16); qsl = torch.arange(B+1)
import ctypes
old = ctypes.CDLL(os.environ.get("OLD_SO", "old_attn.so")) if os.environ.get("OLD") else None; fn = old.paged_decode_bf16 if old else None
if fn: fn.restype = None; fn.argtypes = [ctypes.c_void_p]*6 + [ctypes.c_int]*6 + [ctypes.c_float, ctypes.c_int64]
def call_old(kc, vc):
    out = torch.empty_like(q)
    fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), B, H, KV, D, BS, mb, D**-0.5, 0)
use_old = bool(os.environ.get("OLD"))
if use_old: torch.set_num_threads(int(os.environ.get("KT", 2)))
steps = []
for _ in range(int(os.environ.get("N", 10))):
    t = time.perf_counter()
    for kc, vc in pools:
        if use_old: call_old(kc, vc)
        else: ops.paged_attention(q, kc, vc, tables, lens, qsl, D**-0.5, 0)
    steps.append(time.perf_counter() - t)
m = statistics.median(steps[1:])
print(("old " if use_old else "new ") + f"B={B} L={L} KT={os.environ.get('KT', 2)}: {m*1e3:.2f} ms per 30 layers, {m/30*1e3:.3f} ms/layer, {B*L*KV*D*2*2/(m/30)/1e9:.1f} GB/s")
