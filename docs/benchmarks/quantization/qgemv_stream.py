"""The linears of one SmolLM2 step as the engine reads them (30 layers of distinct weights +
the 49152 x 576 LM head), M input rows: bf16 GEMV kernel, int8 and int4 `qgemv`, the bf16
small-M GEMM and its int8 and int4 (group 32) variants (`gemm` over `Int8Panels`, `Int4Panels`).

Usage: python qgemv_stream.py M [M ...]; env KT kernel threads (2), TT torch threads (2).
Prints per M the median time of one pass over all weights and the bytes it read per second.
"""
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("TT", 2)))
from pagoda.layers import cpu_kernels  # noqa: E402
from pagoda.layers.cpu_kernels import ops  # noqa: E402
from pagoda.layers.quantization import packing  # noqa: E402

cpu_kernels.library()
ops.set_num_threads(int(os.environ.get("KT", 2)))
H, I, V = 576, 1536, 49152
shapes = [(960, H), (H, H), (2 * I, H), (H, I)] * 30 + [(V, H)]
torch.manual_seed(0)
dense = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for n, k in shapes]
kinds = {
    "bf16-gemv": [(w,) for w in dense],
    "int8": [(packing.quantize_int8(w.float()), ops.INT8, w.shape[1], w.shape[1]) for w in dense],
    "int4-g32": [(packing.quantize_int4(w.float(), 32), ops.INT4, w.shape[1], 32) for w in dense],
    "int4-g64": [(packing.quantize_int4(w.float(), 64), ops.INT4, w.shape[1], 64) for w in dense],
    "bf16-gemm": [(ops.PackedWeight(w),) for w in dense],
    "int8-gemm": [(ops.Int8Panels(*packing.unpack_int8(packing.quantize_int8(w.float()), w.shape[1])),)
                  for w in dense],
}
for gs in (32, 64):  # SmolLM2's 576 and 1536 take no groups of 128
    kinds[f"int4-gemm{'' if gs == 32 else f'-g{gs}'}"] = [
        (ops.Int4Panels(*packing.unpack_int4(packing.quantize_int4(w.float(), gs), w.shape[1], gs), gs),) for w in dense]
only = os.environ.get("KINDS")
if only:
    kinds = {k: v for k, v in kinds.items() if k in only.split(",")}
def size(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    scales = getattr(w, "scales", None)
    return w.data.numel() * w.data.element_size() + (0 if scales is None else scales.numel() * scales.element_size())


nbytes = {k: sum(size(t[0]) for t in v) for k, v in kinds.items()}


def run(m: int, kind: str) -> float:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (H, I)}
    t = time.perf_counter()
    for args in kinds[kind]:
        if "gemm" in kind:
            w = args[0]
            ops.gemm(xs[w.k], w)
            continue
        x = xs[args[0].shape[1] if kind == "bf16-gemv" else args[2]]
        if kind == "bf16-gemv":
            ops.gemv(x, args[0])
        else:
            ops.qgemv(x, *args)
    return time.perf_counter() - t


for m in [int(a) for a in sys.argv[1:]] or [1]:
    res: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(7):
        for k in kinds:
            res[k].append(run(m, k))
    line = " ".join(f"{k} {statistics.median(v[1:]) * 1e3:6.2f} ms ({nbytes[k] / statistics.median(v[1:]) / 1e9:4.1f} GB/s)"
                    for k, v in res.items())
    print(f"M={m}: {line}")
