"""Greedy sampling's argmax of bf16 logits: the torch path (widened to fp32, then every 1024-wide
chunk's maximum and an argmax inside the winning chunk: `sampler.argmax_rows` without the CPU
kernels) against the kernel on the bf16 rows as they are (`ops.argmax_rows`), two threads.
Usage: python docs/benchmarks/kernels/greedy_argmax.py   (prints ms a call, median of 30)
"""
import statistics
import time

import torch

import pagoda.layers.cpu_kernels as cpu_kernels
from pagoda import sampler
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
ops.set_num_threads(2)


def timed(fn) -> float:
    fn()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


print("| rows x vocab | torch path (fp32 copy + chunked amax), ms | kernel on bf16, ms | ratio |")
print("|---|---|---|---|")
for rows, vocab in ((1, 49152), (16, 49152), (64, 49152), (1, 262144), (16, 262144), (64, 262144)):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    takes = cpu_kernels.takes
    cpu_kernels.takes = lambda t: False
    try:
        plain = timed(lambda x=x: sampler.argmax_rows(x))
    finally:
        cpu_kernels.takes = takes
    native = timed(lambda x=x: sampler.argmax_rows(x))
    assert torch.equal(sampler.argmax_rows(x), x.float().argmax(dim=-1))
    print(f"| {rows} x {vocab} | {plain:.3f} | {native:.3f} | {plain / native:.1f}x |")
