"""One input row through the int8 records' GEMV (`ops.qgemv`, groups of 32, f16 scales: GGUF's
Q8_0 and the Q5 kinds as int8) over Gemma 3 270M's tied LM head shape (262144 x 640, 178 MB of
records, far larger than any cache), against a flat read of as many bytes (`torch.max`, two
threads). Medians of 13 passes, the two interleaved; GB/s of records read.
Usage: python docs/benchmarks/kernels/qgemv_row.py [N=262144] [K=640]     Env: KT kernel threads (2).
"""
import os, statistics, sys, time
import torch
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

cpu_kernels.library(); ops.set_num_threads(int(os.environ.get("KT", 2)))
torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 262144
K = int(sys.argv[2]) if len(sys.argv) > 2 else 640
g = torch.Generator().manual_seed(0)
packed = torch.randint(0, 256, (N, K + 2 * (K // 32)), dtype=torch.uint8, generator=g)
packed.view(torch.int16)[:, K // 2:] = 0x2000  # every f16 group scale 2^-7
x = torch.randn(1, K, dtype=torch.bfloat16, generator=g)
flat = torch.empty(packed.numel(), dtype=torch.uint8).random_()
times: dict[str, list[float]] = {"int8 records, one row": [], "flat read": []}
for _ in range(15):
    t = time.perf_counter(); ops.qgemv(x, packed, ops.INT8, K, 32); times["int8 records, one row"].append(time.perf_counter() - t)
    t = time.perf_counter(); flat.max(); times["flat read"].append(time.perf_counter() - t)
mb = packed.numel() / 1e6
print(f"{N} x {K}, {mb:.0f} MB, KT={os.environ.get('KT', 2)}")
for name, v in times.items():
    m = statistics.median(v[2:])
    print(f"  {name:24s} {m * 1e3:7.2f} ms  {mb / m / 1e3:5.1f} GB/s")
