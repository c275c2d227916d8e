"""The linears of one SmolLM2 step as the engine reads them: 30 layers of distinct weights
(212 MB) + the LM head (57 MB), M input rows; the GEMV kernel against oneDNN's prepacked path.

Usage: python gemv_stream.py M [M ...]; env TT torch threads (2), KT kernel threads (2), HUGE=1.
"""
import os, time, statistics, sys
import torch
tt = int(os.environ.get("TT", 2)); torch.set_num_threads(tt)
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
H, I, V = 576, 1536, 49152
shapes = [(960, H), (H, H), (2*I, H), (H, I)]
torch.manual_seed(0)
layers = [[(torch.randn(N, K) * 0.05).to(torch.bfloat16) for N, K in shapes] for _ in range(30)]
packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws] for ws in layers]
lm = (torch.randn(V, H) * 0.05).to(torch.bfloat16)
if os.environ.get("HUGE"):
    from huge_pages import move_to_huge_pages
    flat = move_to_huge_pages([w for ws in layers for w in ws] + [lm])
    layers = [flat[i*4:(i+1)*4] for i in range(30)]; lm = flat[-1]
lmp = torch.ops.mkldnn._reorder_linear_weight(lm, 1)
def run(M, kind):
    xs = {K: torch.randn(M, K).to(torch.bfloat16) for K in (H, I)}
    t = time.perf_counter()
    for ws, ps in zip(layers, packed):
        for (N, K), w, p in zip(shapes, ws, ps):
            if kind == "gemv": ops.gemv(xs[K], w)
            else: torch.ops.mkldnn._linear_pointwise(xs[K], p, None, "none", [], "")
    if kind == "gemv": ops.gemv(xs[H], lm)
    else: torch.ops.mkldnn._linear_pointwise(xs[H], lmp, None, "none", [], "")
    return time.perf_counter() - t
for M in [int(m) for m in sys.argv[1:]] or [1]:
    res = {"gemv": [], "onednn": []}
    for rep in range(9):
        for k in res: res[k].append(run(M, k))
    g, o = statistics.median(res["gemv"][1:]), statistics.median(res["onednn"][1:])
    print(f"TT={tt} KT={os.environ.get('KT', 2)} M={M}: gemv {g*1e3:6.2f} ms ({269e6/g/1e9:.1f} GB/s)  onednn-packed {o*1e3:6.2f} ms  ratio {o/g:4.2f}x")
if os.environ.get("HUGE"):
    pass
