"""The gate/up product with the gated activation in its epilogue (`ops.gemm_gated`) against the
product and then the elementwise kernel: bit for bit (each factor is rounded to bf16 as the
product stores it, then act(gate) * up as the elementwise kernels compute it), on bf16, int8
(per-row scales, f16 group scales, fp32 group scales and offsets), int4 and int5 (GGUF's Q5_0) panels, over one and two row tiles, several blocks, passes of 256 and of 768 rows.
Only AMX passes fuse: elsewhere (another CPU or build, rows under the AMX choice, a gate width
that is no multiple of a panel) `gemm_gated` declines and the decoder stack runs both kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from test_cpu_kernels import variant  # noqa: F401 - autouse: every test under each variant
from test_quantization_kernels import packed_weight

from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

pytestmark = pytest.mark.skipif(bool(os.environ.get("PAGODA_DISABLE_CPU_KERNELS")),
                                reason="PAGODA_DISABLE_CPU_KERNELS is set")

ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}


def make_weight(kind: str, n: int, k: int, gen: torch.Generator) -> ops.PackedWeight | ops.Int8Panels | ops.Int4Panels:
    if kind == "bf16":
        return ops.PackedWeight((torch.randn(n, k, generator=gen) * 0.08).to(torch.bfloat16))
    if kind == "int8":
        return ops.Int8Panels(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                              torch.rand(n, generator=gen) * 0.002)
    if kind == "int8_f16_groups":  # GGUF's Q8_0 and Q5_0
        return ops.Int8Panels(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                              (torch.rand(n, k // 32, generator=gen) * 0.002).half().float())
    if kind == "int8_f32_groups":  # the k-quants: narrow codes, fp32 d and m by groups of 16
        return ops.Int8Panels(torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8),
                              torch.rand(n, k // 16, generator=gen) * 0.005, -torch.rand(n, k // 16, generator=gen) * 0.01)
    if kind == "int5":  # GGUF's Q5_0: codes in [0, 31], m = -16 d
        d = (torch.rand(n, k // 32, generator=gen) * 0.002).half()
        return ops.Int4Panels(torch.randint(0, 32, (n, k), generator=gen, dtype=torch.uint8), d, -16 * d, 32)
    if kind == "int5_f32":  # GGUF's Q5_K: codes in [0, 31], fp32 d and m
        return ops.Int4Panels(torch.randint(0, 32, (n, k), generator=gen, dtype=torch.uint8),
                              torch.rand(n, k // 32, generator=gen) * 0.002, -torch.rand(n, k // 32, generator=gen) * 0.01,
                              32, fp32_scales=True)
    return ops.Int4Panels(*packing.unpack_int4(packed_weight("int4", n, k, 32, gen), k, 32), 32)


def set_amx_rows(kind: str, rows: int) -> bool:
    if kind == "bf16":
        return ops.set_gemm_amx_rows(rows)
    return ops.set_gemm_amx_integer_rows(4 if kind in ("int4", "int5", "int5_f32") else 8, rows)


@pytest.fixture(params=["bf16", "int8", "int8_f16_groups", "int8_f32_groups", "int4", "int5", "int5_f32"])
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """A panel kind, its AMX row choice restored after."""
    before = ops.GEMM_AMX_ROWS, dict(ops.GEMM_AMX_INTEGER_ROWS)
    yield request.param
    ops.set_gemm_amx_rows(before[0])
    for bits, rows in before[1].items():
        ops.set_gemm_amx_integer_rows(bits, rows)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_product_equals_product_then_elementwise(kind: str, act: str) -> None:
    gen = torch.Generator().manual_seed(7)
    try:
        weight = make_weight(kind, 64, 64, gen)
    except ValueError as e:  # NOTE: the portable build holds no group scales
        pytest.skip(f"this build takes no such panels: {e}")
    if not set_amx_rows(kind, 1):
        assert ops.gemm_gated(torch.randn(40, 64).to(torch.bfloat16), weight, act) is None
        pytest.skip("no AMX tiles here (CPU or build): the product declines, as checked")
    for m, half, k, bias in [(1, 32, 64, False), (16, 64, 128, True), (17, 96, 576, False), (33, 32, 64, True),
                             (300, 64, 128, True), (300, 160, 128, False), (800, 32, 64, False)]:
        weight = make_weight(kind, 2 * half, k, gen)
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
        b = torch.randn(2 * half, generator=gen).to(torch.bfloat16) if bias else None
        got = ops.gemm_gated(x, weight, act, b)
        assert got is not None
        assert torch.equal(got, ELEMENTWISE[act](ops.gemm(x, weight, b))), (m, half, k, bias)


def test_gated_product_declines_what_it_cannot_fuse(kind: str) -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(40, 64).to(torch.bfloat16)
    if not set_amx_rows(kind, 41):  # NOTE: no AMX, so neither the portable build's refusal of groups
        pytest.skip("no AMX tiles here (CPU or build)")
    assert ops.gemm_gated(x, make_weight(kind, 64, 64, gen), "silu") is None  # 40 rows, AMX from 41
    set_amx_rows(kind, 1)
    assert ops.gemm_gated(x, make_weight(kind, 96, 64, gen), "silu") is None  # 48 gate columns: no panels
    assert ops.gemm_gated(x, make_weight(kind, 64, 64, gen), "silu") is not None
