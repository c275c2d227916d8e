"""int8 weights with fp32 scales by groups of 16 (GGUF's Q6_K) or 32 with offsets (Q5_K, and
layers whose sources mix Q4_K and Q6_K), as records (`ops.qgemv`, what they ran on before) and
as the GEMM's panels with fp32 group scales (`ops.Int8Panels`, the avx2 and avx512bf16 builds), M rows.

A pass over a model's layers of that kind, so that the weights stream from memory as in a step:
the Llama-3.2-1B shape's Q4_K_M file (8 down projections 2048 x 8192 and the tied LM head
49152 x 2048 in Q6_K; 8 fused qkv 3072 x 2048 mixing Q4_K q/k with a Q6_K v: groups of 16 with
offsets) or SmolLM2's (14 down projections 576 x 1536 in Q6_K).

Usage: python f32_group_panels.py [1b|smollm2] M [M ...]   (random codes; prints ms a pass,
median of 5 passes after one, and records / panels)

`python f32_group_panels.py narrow M [M ...]`: f16-group panels (GGUF's Q5_0 and Q8_0), wide
codes against narrow ones, SmolLM2's 30 layers as its Q4_K_M file holds them in Q5_0 (fused qkv
960 x 576, o 576 x 576, gate/up 3072 x 576): once with codes in [-16, 15] (Q5_0's: the avx2
build's narrow kind, stored + 32 and multiplied unsigned), once with one code per row set to
127 (the wide kind, stored + 128, the weight's sign moved onto x).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

SHAPES = {  # (N, K, group, offsets, count)
    "1b": [(2048, 8192, 16, False, 8), (49152, 2048, 16, False, 1), (3072, 2048, 16, True, 8)],
    "smollm2": [(576, 1536, 16, False, 14)],
}


def layers(shape: str) -> list[tuple[torch.Tensor, torch.Tensor | None, ops.Int8Panels, int]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k, group, offsets, count in SHAPES[shape]:
        for _ in range(count):
            codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
            d = torch.rand(n, k // group, generator=gen) / 100
            m = -torch.rand(n, k // group, generator=gen) / 20 if offsets else None
            out.append((packing.pack_int8(codes, d), m, ops.Int8Panels(codes, d, m), group))
    return out


def timed(fn: Callable[[], None]) -> float:
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def f16_panels(narrow: bool) -> list[ops.Int8Panels]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(30):
        for n, k in [(960, 576), (576, 576), (3072, 576)]:
            codes = torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8)
            if not narrow:
                codes[:, 0] = 127
            out.append(ops.Int8Panels(codes, (torch.rand(n, k // 32, generator=gen) / 100).half().float()))
    return out


def wide_against_narrow(rows: list[int]) -> None:
    wide, narrow = f16_panels(False), f16_panels(True)
    print(f"kinds: wide {wide[0].kind}, narrow {narrow[0].kind} (narrow f16 groups: {ops.int8_narrow_tiles()})")
    print("| rows | wide ms | narrow ms | wide / narrow |")
    print("|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, 576).to(torch.bfloat16)

        def run(weights: list[ops.Int8Panels], x: torch.Tensor = x) -> Callable[[], None]:
            def one_pass() -> None:
                for w in weights:
                    ops.gemm(x, w)
            return one_pass

        a, b = timed(run(wide)), timed(run(narrow))
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


def main() -> None:
    shape, rows = sys.argv[1], [int(a) for a in sys.argv[2:]]
    if shape == "narrow":
        wide_against_narrow(rows)
        return
    weights = layers(shape)
    print(f"{shape}: {len(weights)} layers, fp32 group panels: {ops.int8_f32_group_tiles()}")
    print("| rows | records ms | panels ms | records / panels |")
    print("|---|---|---|---|")
    for m in rows:
        x = {w[2].k: torch.randn(m, w[2].k).to(torch.bfloat16) for w in weights}

        def records(x: dict[int, torch.Tensor] = x) -> None:
            for packed, offsets, panels, group in weights:
                xk = x[panels.k]
                y = ops.qgemv(xk, packed, ops.INT8, panels.k, group)
                if offsets is not None:  # NOTE: as PackedLinearMethod adds them outside
                    torch.addmm(y.float(), xk.float().unflatten(-1, (-1, group)).sum(-1), offsets.t())

        def on_panels(x: dict[int, torch.Tensor] = x) -> None:
            for _, _, panels, _ in weights:
                ops.gemm(x[panels.k], panels)

        a, b = timed(records), timed(on_panels)
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
