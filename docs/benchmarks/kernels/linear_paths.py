"""SmolLM2's 30 layers of linears (distinct weights, 212 MB in bf16) through each path a kernel
plan can take, plus torch in fp32 (fp32 weights: what `dtype=float32` runs), at M rows.
Medians of 4 passes (the first dropped), the paths interleaved pass by pass.

Usage: python linear_paths.py [--paths gemm,gemv,torch,f32] M [M ...]
Env: V the kernel build (default: this CPU's), TT torch threads and KT kernel threads (2).
"""
import os, statistics, sys, time
import torch
torch.set_num_threads(int(os.environ.get("TT", 2)))
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops
lib = cpu_kernels.use_variant(os.environ.get("V") or None)
ops.set_num_threads(int(os.environ.get("KT", 2)))
args = sys.argv[1:]
paths = ["gemm", "gemv", "torch", "f32"]
if args and args[0] == "--paths":
    paths, args = args[1].split(","), args[2:]
H, I = 576, 1536
shapes = [(960, H), (H, H), (2 * I, H), (H, I)]
torch.manual_seed(0)
layers = [[(torch.randn(n, k) * 0.05).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
store = {"f32": [[w.float() for w in ws] for ws in layers]} if "f32" in paths else {}
if "gemm" in paths:
    store["gemm"] = [[ops.PackedWeight(w) for w in ws] for ws in layers]
if "onednn" in paths:
    store["onednn"] = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws] for ws in layers]


def one_pass(m: int, kind: str) -> float:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (H, I)}
    xf = {k: v.float() for k, v in xs.items()}
    start = time.perf_counter()
    for li, ws in enumerate(layers):
        for j, w in enumerate(ws):
            k = w.shape[1]
            if kind == "gemm": ops.gemm(xs[k], store["gemm"][li][j])
            elif kind == "gemv": ops.gemv(xs[k], w)
            elif kind == "onednn": torch.ops.mkldnn._linear_pointwise(xs[k], store["onednn"][li][j], None, "none", [], "")
            elif kind == "torch": torch.nn.functional.linear(xs[k], w)
            elif kind == "f32": torch.nn.functional.linear(xf[k], store["f32"][li][j])
    return time.perf_counter() - start


cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"# {cpu}; kernels {lib.variant if lib else 'none'}; load {open('/proc/loadavg').read().split()[:3]}")
for m in [int(a) for a in args] or [1]:
    res: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(5):
        for p in paths:
            res[p].append(one_pass(m, p))
    med = {p: statistics.median(v[1:]) for p, v in res.items()}
    flops = 2 * m * 30 * sum(n * k for n, k in shapes)
    print(f"M={m:4d} " + "  ".join(f"{p} {t * 1e3:7.2f} ms ({flops / t / 1e9:5.0f} GF/s)" for p, t in med.items()), flush=True)
