"""The linears of one SmolLM2 step as the engine reads them: 30 layers of distinct weights
(212 MB) + the LM head (57 MB), M input rows; the small-M GEMM (packed weights) against oneDNN's
prepacked path and the GEMV kernel (plain weights). Medians of 9 passes (the first dropped),
the paths interleaved pass by pass.

Usage: python gemm_stream.py [--paths gemm,onednn,gemv] M [M ...]
Env: TT torch threads (2; oneDNN's), KT kernel threads (2). The runner gives oneDNN one thread
below 12 rows (SMALL_STEP_TOKENS), which "onednn1" reproduces; "gemm1" runs the GEMM on one
kernel thread (the GEMV always uses half the kernel threads); "amx" the GEMM on its AMX tiles at
every row count (CPUs with AMX), "gemm" on the tiles measured at load.
"""
import os, time, statistics, sys
import torch
tt = int(os.environ.get("TT", 2)); torch.set_num_threads(tt)
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
args = sys.argv[1:]
paths = ["gemm", "onednn", "gemv"]
if args and args[0] == "--paths":
    paths, args = args[1].split(","), args[2:]
H, I, V = 576, 1536, 49152
shapes = [(960, H), (H, H), (2*I, H), (H, I)]
torch.manual_seed(0)
layers = [[(torch.randn(N, K) * 0.05).to(torch.bfloat16) for N, K in shapes] for _ in range(30)]
layers.append([(torch.randn(V, H) * 0.05).to(torch.bfloat16)])
shapes_of = lambda ws: [tuple(w.shape) for w in ws]
packed = {}
if any(p in paths for p in ("gemm", "gemm1", "amx")): packed["gemm"] = [[ops.PackedWeight(w) for w in ws] for ws in layers]
if any(p.startswith("onednn") for p in paths):
    packed["onednn"] = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws] for ws in layers]
def run(M, kind):
    xs = {K: torch.randn(M, K).to(torch.bfloat16) for K in (H, I)}
    if kind == "onednn1": torch.set_num_threads(1)
    if kind == "gemm1": ops.set_num_threads(1)
    amx_rows = ops.GEMM_AMX_ROWS
    if kind == "amx" and not ops.set_gemm_amx_rows(1): sys.exit("amx: this CPU has no AMX tiles")
    t = time.perf_counter()
    for li, ws in enumerate(layers):
        for j, w in enumerate(ws):
            x = xs[w.shape[1]]
            if kind.startswith("gemm") or kind == "amx": ops.gemm(x, packed["gemm"][li][j])
            elif kind == "gemv": ops.gemv(x, w)
            else: torch.ops.mkldnn._linear_pointwise(x, packed["onednn"][li][j], None, "none", [], "")
    dt = time.perf_counter() - t
    if kind == "amx": ops.set_gemm_amx_rows(amx_rows)
    torch.set_num_threads(tt)
    ops.set_num_threads(int(os.environ.get("KT", 2)))
    return dt
print(f"# load {open('/proc/loadavg').read().split()[:3]} TT={tt} KT={os.environ.get('KT', 2)}")
for M in [int(m) for m in args] or [1]:
    res = {k: [] for k in paths}
    for rep in range(9):
        for k in res: res[k].append(run(M, k))
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    flops = 2 * M * 134.5e6
    print(f"M={M:4d} " + "  ".join(f"{k} {v*1e3:7.2f} ms ({flops/v/1e9:5.0f} GF/s)" for k, v in med.items()))
