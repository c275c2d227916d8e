"""Quantized weight kernels and fp8 KV kernels against dequantize-then-compute references.

For every compiled variant. Tolerances:
- `qgemv` against F.linear on the dequantized weight in fp32: the kernel's products are exact
  (int4 codes and bf16 activations, int8 codes and fp32 activations; on the avx2 build both
  multiply x rounded to int8 codes by groups of 32, which the reference takes alike, where K
  and the groups allow), its sums fp32 in another
  order and a bf16 output rounded once, so |y - ref| <= 2^-8 |ref| (bf16 output) + 1e-5 sum|x w|
  (fp32 summation order); int4 first rounds fp32 activations to bf16 (2^-9 relative each),
  which the bound takes as 2^-8 sum|x w|. A wrong scale, offset or nibble moves y by about
  |x w| of one element, far outside these bounds.
- `gemm` on int8 panels (bf16 activations) against the same reference: exact products, fp32
  sums, so the same bound as `qgemv` on bf16 activations (x rounded to int8 codes by groups of 32
  on vpdpbusd, which the reference takes alike; as it is on AMX tiles). On int4 panels x is first rounded to
  int8 codes per group (as llama.cpp's Q8_0 activations): the reference takes x rounded alike.
- `dequantize` equals the torch reference bit for bit (same operations, same order).
- fp8 K/V writes equal torch's own conversion of the clamped, scaled values bit for bit;
  attention over an fp8 pool equals attention over the dequantized pool within the usual bound.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_cpu_kernels import variant  # noqa: F401 - autouse: every test under both variants

from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing

pytestmark = pytest.mark.skipif(bool(os.environ.get("PAGODA_DISABLE_CPU_KERNELS")),
                                reason="PAGODA_DISABLE_CPU_KERNELS is set")


def packed_weight(scheme: str, n: int, k: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, generator=gen) * 0.1 + 0.02 * torch.randn(n, 1, generator=gen)
    if scheme == "int4":
        return packing.quantize_int4(w, group_size)
    packed = packing.quantize_int8(w, None if group_size == k else group_size)
    if scheme.startswith("int8_f16"):  # NOTE: scales f16 holds exactly (GGUF's Q8_0): packed as f16
        q, d = packing.unpack_int8(packed, k, group_size)
        if scheme == "int8_f16_min":  # NOTE: GGUF's Q8_0 allows codes of -128 (llama-quantize's never hold one)
            q = q.contiguous()
            q.view(-1)[::7] = -128
        packed = packing.pack_int8(q, d.half().float())
        assert packed.shape[1] == k + 2 * (k // group_size)
    return packed


def dequantized(scheme: str, packed: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    fn = packing.dequantize_int4 if scheme == "int4" else packing.dequantize_int8
    return fn(packed, k, group_size, torch.float32)


CASES = [  # scheme, n, k, group size
    ("int4", 48, 64, 32), ("int4", 100, 576, 32), ("int4", 37, 1536, 64), ("int4", 64, 512, 128),
    ("int8", 48, 64, 64), ("int8", 100, 576, 576), ("int8", 37, 1536, 32), ("int8", 17, 96, 32),
    ("int8", 40, 640, 16),  # GGUF's Q6_K: groups of 16 (x as it is: no int8 rounding by 32)
    # f16 group scales (GGUF's Q8_0 and Q5_0): 20 groups a row (a tail of 4), 48, 3
    ("int8_f16", 100, 640, 32), ("int8_f16", 37, 1536, 32), ("int8_f16", 17, 96, 32),
    ("int8_f16_min", 37, 640, 32),  # and codes of -128, which vpsignb cannot negate
]


@pytest.mark.parametrize("scheme,n,k,group_size", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qgemv_matches_dequantize_then_matmul(scheme: str, n: int, k: int, group_size: int, m: int,
                                              dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * k + m)
    packed = packed_weight(scheme, n, k, group_size, gen)
    w = dequantized(scheme, packed, k, group_size)
    # NOTE: x is a strided view (rows of a wider buffer), as activations split from a fusion.
    x = torch.randn(m, k + 5, generator=gen).to(dtype)[:, :k]
    bias = torch.randn(n, generator=gen).to(dtype)
    fmt = ops.INT4 if scheme == "int4" else ops.INT8
    got = ops.qgemv(x, packed, fmt, k, group_size, bias).float()
    x_group = ops.qgemv_x_group(k, group_size)
    xr = packing.round_to_int8_groups(x, x_group) if x_group else x.float()
    want = F.linear(xr, w, bias.float())
    magnitude = xr.abs() @ w.abs().t()
    out_rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
    act_rounding = 2**-8 if scheme == "int4" and dtype != torch.bfloat16 and not x_group else 1e-5
    excess = (got - want).abs() - (out_rounding * want.abs() + act_rounding * magnitude + 1e-6)
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


@pytest.mark.parametrize("scheme,n,k,group_size", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_kernel_equals_torch(scheme: str, n: int, k: int, group_size: int, dtype: torch.dtype) -> None:
    packed = packed_weight(scheme, n, k, group_size, torch.Generator().manual_seed(k))
    fmt = ops.INT4 if scheme == "int4" else ops.INT8
    fn = packing.dequantize_int4 if scheme == "int4" else packing.dequantize_int8
    assert torch.equal(ops.dequantize(packed, fmt, k, group_size, dtype), fn(packed, k, group_size, dtype))


@pytest.mark.parametrize("scheme,n,k,group_size", [c for c in CASES if c[2] % 64 == 0])
def test_records_through_gemm_equal_qgemv(scheme: str, n: int, k: int, group_size: int) -> None:
    """`gemm` (and so the decoder stack) on `Records` runs qgemv on them: the same output."""
    gen = torch.Generator().manual_seed(n + k)
    packed = packed_weight(scheme, n, k, group_size, gen)
    fmt = ops.INT4 if scheme == "int4" else ops.INT8
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    records = ops.Records(packed, fmt, k, group_size)
    assert torch.equal(ops.gemm(x, records, bias), ops.qgemv(x, packed, fmt, k, group_size, bias))


@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_records_with_offsets_outside(group_size: int, m: int, dtype: torch.dtype) -> None:
    """GGUF's Q5_K/Q5_1 (and mixed fused sources): int8 records, w = q * d + m with the
    offsets added outside the kernel as x's group sums times m, in fp32 (methods.py). The
    reference: the records' product as `qgemv`'s tests take it (x rounded where the kernel
    rounds it), plus the offsets' product of x as it is; the same bound."""
    from types import SimpleNamespace

    from pagoda.layers.quantization.methods import PackedLinearMethod

    gen = torch.Generator().manual_seed(group_size + m)
    n, k = 48, 256
    # NOTE: the k-quants' codes (Q5_K's q in [0, 31], Q6_K's q - 32), which panels take too
    packed = packing.pack_int8(torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8),
                               torch.rand(n, k // group_size, generator=gen) / 100)
    offsets = torch.randn(n, k // group_size, generator=gen) / 10
    method = PackedLinearMethod("int8", packed, k, group_size, offsets)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = method.apply(SimpleNamespace(native=True), x, bias).float()
    x_group = ops.qgemv_x_group(k, group_size)
    xr = packing.round_to_int8_groups(x, x_group) if x_group else x.float()
    records = dequantized("int8", packed, k, group_size)
    sums = x.float().view(m, -1, group_size).sum(-1)
    want = F.linear(xr, records, bias.float()) + sums @ offsets.t()
    magnitude = xr.abs() @ records.abs().t() + sums.abs() @ offsets.abs().t()
    out_rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
    excess = (got - want).abs() - (out_rounding * want.abs() + 1e-5 * magnitude + 1e-6)
    assert excess.max().item() <= 0, f"{m} rows: max excess {excess.max().item():.3g}"
    dense = method.dequantize(torch.float32)
    assert torch.equal(dense, (records.view(n, -1, group_size) + offsets[..., None]).view(n, k))
    assert method.native_weight() is None
    # NOTE: where the GEMM takes fp32 group scales (the avx2 and avx512bf16 builds) the panels hold the offsets
    # and multiply them by the group sums of x rounded to int8 codes by the same groups.
    assert method.use_gemm() == ops.int8_f32_group_tiles()
    if method.use_gemm():
        assert method.offsets is None and method.native_weight() is method.panels and "offsets" in method.name
        assert torch.equal(method.dequantize(torch.float32), dense)
        if dtype == torch.bfloat16:
            panels = method.panels
            exact = (panels.codes().double().view(n, -1, group_size) * panels.row_scales().double()[..., None]
                     + panels.row_offsets().double()[..., None]).view(n, k)
            xg, w = grouped_reference(x, panels, exact, m)
            want = F.linear(xg, w, bias.float())
            excess = (method.apply(SimpleNamespace(native=True), x, bias).float() - want).abs() - (
                out_rounding * want.abs() + 1e-5 * (xg.abs() @ w.abs().t()) + 1e-6)
            assert excess.max().item() <= 0, f"{m} rows on panels: max excess {excess.max().item():.3g}"


def grouped_reference(x: torch.Tensor, weight: ops.Int8Panels, w: torch.Tensor, rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w) as grouped int8 panels multiply them at `rows` rows: on AMX tiles x as it is and
    each weight (w exact, in float64) rounded once to fp32 and then to bf16; else x rounded to
    int8 codes by the weight's groups and w exact."""
    if weight.amx_at(rows):
        return x.float(), w.float().to(torch.bfloat16).float()
    return packing.round_to_int8_groups(x, weight.x_group(rows)), w.float()


def test_qgemv_splits_rows_over_threads() -> None:
    ops.set_num_threads(2)
    try:
        test_qgemv_matches_dequantize_then_matmul("int4", 4096, 576, 32, 1, torch.bfloat16)
        test_qgemv_matches_dequantize_then_matmul("int8", 4096, 576, 576, 2, torch.bfloat16)
    finally:
        ops.set_num_threads(torch.get_num_threads())


def check_qgemm(m: int, n: int, k: int, bias: bool, seed: int) -> None:
    """`gemm` on int8 panels against F.linear on the dequantized weight and x as the kernel
    rounds it (avx512bf16 and avx2: int8 codes by groups of 32; portable: as it is): exact products, fp32
    sums, one bf16 rounding of the scaled output."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01
    # NOTE: strided rows with NaN just past each row's K: an odd K must never read it.
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x = base[:, :k]
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    weight = ops.Int8Panels(codes, scales)
    assert torch.equal(weight.codes(), codes)
    got = ops.gemm(x, weight, b).float()
    w = codes.float() * scales[:, None]
    group = weight.x_group(m)
    xr = packing.round_to_int8_groups(x, group) if group else x.float()
    want = F.linear(xr, w, b.float() if b is not None else None)
    magnitude = xr.abs() @ w.abs().t()
    excess = (got - want).abs() - (2**-8 * want.abs() + 1e-5 * magnitude + 1e-6)
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


def integer_tiles(request: pytest.FixtureRequest, bits: int) -> Iterator[str]:
    """int8 or int4 panels (`bits`) on vpdpbusd (x rounded to int8 codes by groups) or on AMX
    tiles (the weight widened to bf16, x as it is; K a multiple of 32), where the CPU has them;
    restored after."""
    before = ops.GEMM_AMX_INTEGER_ROWS[bits]
    if not ops.set_gemm_amx_integer_rows(bits, 1 if request.param == "amx" else 1 << 62) and request.param == "amx":
        pytest.skip("this CPU or build has no AMX tiles (amx_bf16), or Linux refused the tile data")
    yield request.param
    ops.set_gemm_amx_integer_rows(bits, before)


@pytest.fixture(params=["vpdpbusd", "amx"])
def int8_tiles(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from integer_tiles(request, 8)


@pytest.fixture(params=["vpdpbusd", "amx"])
def int4_tiles(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from integer_tiles(request, 4)


# M covers one tile (up to 6 rows on avx512bf16 and avx2, in passes of 3 on avx2; 12 portable),
# several tiles over chunks, the portable build's wide tiles (96+), AMX's blocks of 16 and 32
# rows; N and K cover SmolLM2's shapes, partial panels and blocks, K not a multiple of 4 or of x's groups of 32.
@pytest.mark.usefixtures("int8_tiles")
@pytest.mark.parametrize("m", [1, 5, 6, 12, 13, 16, 25, 64, 96, 101])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (40, 70, False), (77, 129, True),
                                      (16, 2, False), (33, 1, True)])
def test_qgemm_int8_matches_dequantize_then_matmul(m: int, n: int, k: int, bias: bool) -> None:
    check_qgemm(m, n, k, bias, seed=m * 1000 + n + k)


@pytest.mark.usefixtures("int8_tiles")
def test_qgemm_int8_random_shapes() -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(30):
        m, n, k = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (110, 300, 300))
        if trial % 3 == 0:
            k = -(-k // 32) * 32  # what AMX tiles take
        check_qgemm(m, n, k, trial % 2 == 1, seed=trial)


@pytest.mark.usefixtures("int8_tiles")
@pytest.mark.parametrize("m", [1, 3, 6, 13, 16, 64, 101])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (40, 64, True), (77, 96, False)])
@pytest.mark.parametrize("narrow", [False, True])
def test_qgemm_int8_group_scales_match_dequantize_then_matmul(variant: str, m: int, n: int, k: int,  # noqa: F811
                                                              bias: bool, narrow: bool) -> None:
    """int8 panels with an f16 scale per row and group of 32 (GGUF's Q8_0; `narrow`: codes in
    [-16, 15], Q5_0's, which the avx2 build multiplies unsigned + 32): each group's integer sum
    scaled by its own scale, x rounded to int8 codes by the same groups; on AMX tiles (the
    fixture's "amx" case, from one row) the weights widened to bf16 as they are scaled."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    codes = (torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8) if narrow
             else torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8))
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    if variant == "portable":
        with pytest.raises(ValueError, match="need the avx512bf16 or avx2 kernels"):
            ops.Int8Panels(codes, scales)
        return
    weight = ops.Int8Panels(codes, scales)
    kind = ops.INT8_GROUP_NARROW_PANELS if narrow and ops.int8_narrow_tiles() else ops.INT8_GROUP_PANELS
    assert weight.kind == kind and weight.x_group(m) == (0 if weight.amx_at(m) else 32)
    assert weight.amx_at(m) == (ops.GEMM_AMX_INTEGER_ROWS[8] <= m)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(weight.codes(rows), codes[rows]) and torch.equal(weight.row_scales(rows), scales[rows])
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x = base[:, :k]
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    got = ops.gemm(x, weight, b).float()
    xr, w = grouped_reference(x, weight, (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k), m)
    want = F.linear(xr, w, b.float() if b is not None else None)
    excess = (got - want).abs() - (2**-8 * want.abs() + 1e-5 * (xr.abs() @ w.abs().t()) + 1e-6)
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


def test_int8_group_panels_refuse_what_they_cannot_hold(variant: str) -> None:  # noqa: F811 - the fixture
    if variant == "portable":
        pytest.skip("the portable build holds no group scales")
    codes = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    if not ops.int8_f32_group_tiles():
        with pytest.raises(ValueError, match="not all f16 values"):
            ops.Int8Panels(codes, torch.full((8, 2), 0.1))  # 0.1 is no f16
        with pytest.raises(ValueError, match="need the avx2 or avx512bf16 kernels"):
            ops.Int8Panels(codes, torch.ones(8, 4))  # groups of 16
    with pytest.raises(ValueError, match="expected int8 codes"):
        ops.Int8Panels(codes, torch.ones(8, 3))
    with pytest.raises(ValueError, match="offsets .* do not match"):
        ops.Int8Panels(codes, torch.ones(8, 2), torch.ones(8, 4))
    with pytest.raises(ValueError, match="groups of 16 or 32|need the avx2"):
        ops.Int8Panels(torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 2))  # groups of 24
    wide = torch.full((8, 64), 31, dtype=torch.int8).index_fill_(1, torch.tensor([5]), -33)
    if ops.int8_f32_group_tiles():  # NOTE: any code: + 128 (avx512bf16's kinds, avx2's wide ones)
        weight = ops.Int8Panels(wide, torch.ones(8, 4))
        assert weight.code_bias == 128 and torch.equal(weight.codes(), wide)
        assert (weight.kind == ops.INT8_F32_GROUP_WIDE_PANELS) == ops.int8_f32_wide_tiles()


@pytest.mark.usefixtures("int8_tiles")
@pytest.mark.parametrize("m", [1, 2, 4, 6, 13, 16, 64])
@pytest.mark.parametrize("group,offsets,wide", [(16, False, False), (16, True, False), (32, True, False),
                                               (32, False, False), (32, True, True)])
@pytest.mark.parametrize("n,k", [(96, 256), (40, 512), (77, 96)])
def test_int8_panels_with_fp32_group_scales_and_offsets(variant: str, m: int, group: int, offsets: bool,  # noqa: F811
                                                        wide: bool, n: int, k: int) -> None:
    """int8 panels with fp32 scales d (and offsets m) per row and group of 16 or 32 (GGUF's Q6_K;
    Q5_K, Q5_1 and mixed layers with offsets): w = q * d + m, x rounded to int8 codes by the
    weight's groups, the offsets multiplying each group's sum of the rounded x; on AMX tiles
    each weight computed in fp32 and widened to bf16, x as it is. The avx2 and avx512bf16
    builds'; the portable one refuses them (and those layers keep their records). `wide`: codes
    in [-127, 127] (a layer mixing Q8_0 with offset kinds): avx512bf16's own kinds, avx2's wide
    ones (stored + 128, |q| times x's codes with q's sign)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + group)
    codes = torch.randint(-127 if wide else -32, 128 if wide else 32, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.randn(n, k // group, generator=gen) * 0.01  # NOTE: no f16 values
    zero = -torch.rand(n, k // group, generator=gen) * 0.05 if offsets else None
    if variant == "portable" or not ops.int8_f32_group_tiles():
        with pytest.raises(ValueError, match="need the avx|f16 on this build"):
            ops.Int8Panels(codes, scales, zero)
        return
    weight = ops.Int8Panels(codes, scales, zero)
    assert weight.code_bias == (128 if wide else ops.int8_f32_bias())
    assert weight.group_size == group and weight.has_offsets == offsets
    assert weight.amx_at(m) == (ops.GEMM_AMX_INTEGER_ROWS[8] <= m)
    assert weight.x_group(m) == (0 if weight.amx_at(m) else group)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(weight.codes(rows), codes[rows]) and torch.equal(weight.row_scales(rows), scales[rows])
    assert weight.row_offsets(rows) is None if zero is None else torch.equal(weight.row_offsets(rows), zero[rows])
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = ops.gemm(x, weight).float()
    w = codes.double().view(n, -1, group) * scales.double()[..., None]
    w = (w if zero is None else w + zero.double()[..., None]).view(n, k)
    xr, w = grouped_reference(x, weight, w, m)
    want = F.linear(xr, w)
    excess = (got - want).abs() - (2**-8 * want.abs() + 1e-5 * (xr.abs() @ w.abs().t()) + 1e-6)
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


def check_qgemm_int4(m: int, n: int, k: int, group_size: int, bias: bool, seed: int) -> None:
    """`gemm` on int4 panels against F.linear on the dequantized weight (bf16 activations)."""
    gen = torch.Generator().manual_seed(seed)
    packed = packed_weight("int4", n, k, group_size, gen)
    weight = ops.Int4Panels(*packing.unpack_int4(packed, k, group_size), group_size)
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x = base[:, :k]
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    got = ops.gemm(x, weight, b).float()
    w = dequantized("int4", packed, k, group_size)
    if weight.amx_at(m):  # AMX tiles: the weight widened to bf16 (q * d + m rounded once to fp32, then to bf16)
        q, d, off = packing.unpack_int4(packed, k, group_size)
        exact = q.double().reshape(n, -1, group_size) * d.double()[..., None] + off.double()[..., None]
        w, xr = exact.reshape(n, k).float().to(torch.bfloat16).float(), x.float()
    else:
        xr = packing.round_to_int8_groups(x, group_size)
    want = F.linear(xr, w, b.float() if b is not None else None)
    magnitude = xr.abs() @ w.abs().t()
    excess = (got - want).abs() - (2**-8 * want.abs() + 1e-5 * magnitude + 1e-6)
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


def test_qgemm_int4_rounds_x_to_int8_by_group(int4_tiles: str) -> None:
    """Against bf16 x, the error is x's rounding (at most half a step an element), and it is there:
    the kernel is not the exact product."""
    gen = torch.Generator().manual_seed(3)
    packed = packed_weight("int4", 64, 256, 32, gen)
    weight = ops.Int4Panels(*packing.unpack_int4(packed, 256, 32), 32)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    w = dequantized("int4", packed, 256, 32)
    got, exact = ops.gemm(x, weight).float(), F.linear(x.float(), w)
    step = x.float().reshape(8, -1, 32).abs().amax(-1) / 127
    bound = (step / 2) @ w.abs().reshape(64, -1, 32).sum(-1).t()
    if weight.amx_at(8):
        pytest.skip("AMX tiles multiply x as it is")
    assert ((got - exact).abs() <= bound + 2**-8 * exact.abs() + 1e-6).all()
    assert not torch.equal(got, F.linear(x.float(), w).to(torch.bfloat16).float())


@pytest.mark.usefixtures("int4_tiles")
@pytest.mark.parametrize("m", [1, 2, 5, 6, 12, 13, 16, 25, 64, 101])
@pytest.mark.parametrize("n,k,group_size,bias", [(960, 576, 32, False), (576, 1536, 32, True), (40, 128, 64, True),
                                                 (77, 512, 128, False), (16, 64, 32, True), (33, 256, 64, False)])
def test_qgemm_int4_matches_dequantize_then_matmul(m: int, n: int, k: int, group_size: int, bias: bool) -> None:
    check_qgemm_int4(m, n, k, group_size, bias, seed=m * 1000 + n + k)


def test_int4_panels_unpack_to_the_records() -> None:
    gen = torch.Generator().manual_seed(2)
    packed = packed_weight("int4", 45, 192, 64, gen)
    q, d, m = packing.unpack_int4(packed, 192, 64)
    weight = ops.Int4Panels(q, d, m, 64)
    for got, want in zip(weight.unpack(), (q, d, m), strict=True):
        assert torch.equal(got, want)
    rows = torch.tensor([44, 0, 17, 16, 31, 32])
    for got, want in zip(weight.unpack(rows), (q[rows], d[rows], m[rows]), strict=True):
        assert torch.equal(got, want)


def q5_0(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q5_0-like int8 codes in [-16, 15] and f16-valued scales by groups of 32."""
    return (torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8),
            (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float())


def int5_panels(codes: torch.Tensor, scales: torch.Tensor) -> ops.Int4Panels:
    return ops.Int4Panels((codes.to(torch.int16) + 16).to(torch.uint8), scales.half(), (-16 * scales).half(), 32)


@pytest.fixture
def int5_and_int8_tiles(int4_tiles: str) -> Iterator[str]:
    """int4_tiles' choice for the int8 panels too (int5 panels follow int4's), restored after."""
    before = ops.GEMM_AMX_INTEGER_ROWS[8]
    ops.set_gemm_amx_integer_rows(8, ops.GEMM_AMX_INTEGER_ROWS[4])
    yield int4_tiles
    ops.set_gemm_amx_integer_rows(8, before)


def q5_k(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q5_K-like codes in [0, 31] with fp32 scales and offsets by groups of 32 (products of
    f16 super-block scales and 6-bit sub-block ones: no f16 values)."""
    return (torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8),
            torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4, -torch.rand(n, k // 32, generator=gen) * 0.1)


@pytest.mark.usefixtures("int5_and_int8_tiles")
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 25, 64, 101])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (40, 64, True), (77, 96, False)])
def test_int5_panels_with_fp32_scales_give_q5_ks_int8_panel_bits(variant: str, m: int, n: int, k: int,  # noqa: F811
                                                                 bias: bool) -> None:
    """GGUF's Q5_K (q in [0, 31], fp32 d and m by groups of 32) as int5 panels with fp32 scales:
    the bits of the int8 panels with fp32 group scales and offsets, on vpdpbusd (the same integer
    sums, then m and d in the same order) and on AMX tiles (q * d + m, one FMA, as they widen)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + 1)
    codes, scales, offsets = q5_k(n, k, gen)
    if not ops.int5_tiles():
        with pytest.raises(ValueError, match="fp32 scales need the avx512bf16 kernels"):
            ops.Int4Panels(codes.to(torch.uint8), scales, offsets, 32, fp32_scales=True)
        return
    five = ops.Int4Panels(codes.to(torch.uint8), scales, offsets, 32, fp32_scales=True)
    eight = ops.Int8Panels(codes, scales, offsets)
    assert five.kind == ops.INT5_F32_PANELS and five.has_offsets
    q, d, off = five.unpack(torch.tensor([n - 1, 0]))
    assert torch.equal(q, codes[[n - 1, 0]].to(torch.uint8)) and torch.equal(d, scales[[n - 1, 0]])
    assert torch.equal(off, offsets[[n - 1, 0]])
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    assert torch.equal(ops.gemm(base[:, :k], five, b), ops.gemm(base[:, :k], eight, b))


@pytest.mark.usefixtures("int5_and_int8_tiles")
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 25, 64, 101])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (40, 64, True), (77, 96, False)])
def test_int5_panels_give_q5_0s_int8_panel_bits(variant: str, m: int, n: int, k: int, bias: bool) -> None:  # noqa: F811
    """GGUF's Q5_0 (q in [-16, 15], f16 d by groups of 32) as int5 panels (q + 16: int4's nibbles
    and a plane of fifth bits, 5 bits a weight) gives the int8 panels' bits exactly: on vpdpbusd the
    offset -16 d is taken in the integer sums, on AMX tiles the widened weights are the same. A
    wrong fifth bit moves an output by 16 d x, far from equal."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    codes, scales = q5_0(n, k, gen)
    if not ops.int5_tiles():
        with pytest.raises(ValueError, match=r"in \[0, 31\] where this build has int5 panels"):
            int5_panels(codes, scales)
        return
    five, eight = int5_panels(codes, scales), ops.Int8Panels(codes, scales)
    cols = -(-n // 32) * 32  # NOTE: 5 bits a weight and an f16 d a group: GGUF's Q5_0 blocks, 22 bytes a 32
    assert five.kind == ops.INT5_PANELS and five.data.numel() + 2 * five.scales.numel() == cols * k // 32 * 22
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    assert torch.equal(ops.gemm(base[:, :k], five, b), ops.gemm(base[:, :k], eight, b))


def test_int5_panels_unpack_and_refusals(variant: str) -> None:  # noqa: F811 - the fixture
    if not ops.int5_tiles():
        pytest.skip("this build has no int5 panels (the refusal: test_int5_panels_give_q5_0s_int8_panel_bits)")
    gen = torch.Generator().manual_seed(6)
    codes, scales = q5_0(45, 192, gen)
    weight = int5_panels(codes, scales)
    q, d, m = weight.unpack()
    assert torch.equal(q.to(torch.int16) - 16, codes.to(torch.int16)) and torch.equal(d.float(), scales)
    assert torch.equal(m.float(), -16 * scales)
    rows = torch.tensor([44, 0, 17, 16, 31, 32])
    assert torch.equal(weight.unpack(rows)[0], q[rows])
    with pytest.raises(ValueError, match="offsets m = -16 d"):
        ops.Int4Panels(q, d, -15 * d, 32)
    with pytest.raises(ValueError, match="got a code of 32"):
        ops.Int4Panels(q.clamp(max=31).index_fill_(1, torch.tensor([3]), 32), d, -16 * d, 32)
    assert ops.Int4Panels(q.clamp(max=15), d, m, 32).kind == ops.INT4_PANELS  # four bits fit: int4


def panel_kinds(gen: torch.Generator, n: int, k: int) -> dict[str, ops.Int8Panels | ops.Int4Panels]:
    """One weight of every integer panel kind this build holds (n x k, k a multiple of 64)."""
    kinds: dict[str, ops.Int8Panels | ops.Int4Panels] = {}
    wide = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    narrow = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    kinds["int8 per row"] = ops.Int8Panels(wide, torch.rand(n, generator=gen) * 0.01)
    if ops.panels_are_native():  # NOTE: group scales need format 2 (the avx512bf16 and avx2 builds)
        kinds["int8 f16 groups (Q8_0)"] = ops.Int8Panels(wide, (torch.rand(n, k // 32, generator=gen) * 0.01).half().float())
        kinds["int8 f16 groups, narrow (Q5_0)"] = ops.Int8Panels(*q5_0(n, k, gen))
    if ops.int8_f32_group_tiles():
        kinds["int8 fp32 groups of 16 (Q6_K)"] = ops.Int8Panels(narrow, torch.rand(n, k // 16, generator=gen) * 0.01)
        kinds["int8 fp32 groups, offsets (Q5_K)"] = ops.Int8Panels(
            narrow, torch.rand(n, k // 32, generator=gen) * 0.01, -torch.rand(n, k // 32, generator=gen) * 0.05)
    kinds["int4"] = ops.Int4Panels(*packing.unpack_int4(packed_weight("int4", n, k, 32, gen), k, 32), 32)
    if ops.int5_tiles():
        kinds["int5 (Q5_0)"] = int5_panels(*q5_0(n, k, gen))
        codes, scales, offsets = q5_k(n, k, gen)
        kinds["int5, fp32 scales (Q5_K)"] = ops.Int4Panels(codes.to(torch.uint8), scales, offsets, 32, fp32_scales=True)
    return kinds


def test_panel_rows_equal_the_torch_dequantization(variant: str) -> None:  # noqa: F811 - the fixture
    """`panel_rows` (an embedding read from a tied, packed LM head, one native call) gives each
    kind's rows as the torch reference dequantizes them: w = q * d (+ m) in fp32, two roundings,
    then bf16 once; bit for bit. A wrong nibble, fifth bit, scale or offset moves a weight by far
    more than its rounding."""
    gen = torch.Generator().manual_seed(9)
    rows = torch.tensor([[69, 0], [17, 33], [5, 32]])
    for name, weight in panel_kinds(gen, 70, 128).items():
        got = ops.panel_rows(weight, rows)
        if got is None:
            assert variant == "portable" and isinstance(weight, ops.Int8Panels), name  # NOTE: its format 0
            continue
        ids = rows.reshape(-1)
        if isinstance(weight, ops.Int8Panels):
            q, d, m = weight.codes(ids).float(), weight.row_scales(ids), weight.row_offsets(ids)
            w = (q.view(len(ids), d.shape[1], -1) * d[..., None])
            w = w if m is None else w + m[..., None]
        else:
            q4, d4, m4 = weight.unpack(ids)
            w = q4.float().view(len(ids), -1, 32) * d4.float()[..., None] + m4.float()[..., None]
        assert torch.equal(got, w.reshape(len(ids), -1).to(torch.bfloat16)), name
    with pytest.raises(IndexError, match="outside"):
        ops.panel_rows(weight, torch.tensor([70]))


def test_panels_gathered_in_huge_pages_compute_the_same() -> None:
    """`gather_in_huge_pages` moves int8 and int4 panels (codes and scales) into one buffer;
    the GEMM then reads them there and gives the same bits."""
    gen = torch.Generator().manual_seed(4)
    int8 = ops.Int8Panels(torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8), torch.rand(40, generator=gen))
    int4 = ops.Int4Panels(*packing.unpack_int4(packed_weight("int4", 33, 128, 32, gen), 128, 32), 32)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    x4 = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    before = ops.gemm(x, int8), ops.gemm(x4, int4), int8.codes(), int4.unpack()
    old = int8.data.data_ptr(), int4.scales.data_ptr()
    ops.gather_in_huge_pages([int8, int4])
    assert int8.data.data_ptr() % (2 << 20) == 0 and (int8.data.data_ptr(), int4.scales.data_ptr()) != old
    assert int8.desc.data == int8.data.data_ptr() and int4.desc.scales == int4.scales.data_ptr()
    assert torch.equal(ops.gemm(x, int8), before[0]) and torch.equal(ops.gemm(x4, int4), before[1])
    assert torch.equal(int8.codes(), before[2])
    assert all(torch.equal(a, b) for a, b in zip(int4.unpack(), before[3], strict=True))


def test_int8_panels_rows_and_refusals(variant: str) -> None:  # noqa: F811 - the fixture
    codes = torch.randint(-127, 128, (70, 64), dtype=torch.int8)
    weight = ops.Int8Panels(codes, torch.ones(70))
    assert weight.format == (0 if variant == "portable" else 2)
    rows = torch.tensor([69, 0, 33, 33])
    assert torch.equal(weight.codes(rows), codes[rows])
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(4, 63).to(torch.bfloat16), weight)
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(4, 64), weight)
    with pytest.raises(ValueError):
        ops.Int8Panels(codes.float(), torch.ones(70))
    codes[3, 5] = -128  # NOTE: codes + 128 must fit a byte
    with pytest.raises(ValueError, match="-128"):
        ops.Int8Panels(codes, torch.ones(70))


# ---------------------------------------------------------------- fp8 KV cache

def hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 16, 64, 128, 256])
def test_hadamard_kernel_equals_torch_bit_for_bit_and_keeps_dot_products(dtype: torch.dtype, head_dim: int) -> None:
    """The kernel and `rotate_heads` give the same bits (same butterflies, same order, one
    rounding); both are x . H within that rounding, and q.k is what it was."""
    from pagoda.layers.attention_backend import rotate_heads

    gen = torch.Generator().manual_seed(head_dim)
    # NOTE: heads strided inside rows strided apart, as q and k sit in the fused qkv output.
    base = (torch.randn(9, 7 * head_dim + 5, generator=gen) * 4).to(dtype)
    x = base[:, :6 * head_dim].view(9, 3, 2 * head_dim)[:, :, :head_dim]
    want = rotate_heads(x)
    got = x.clone()
    ops.hadamard_inplace(x)
    assert torch.equal(x, want) and not torch.equal(x, got)
    exact = got.double() @ hadamard_matrix(head_dim)
    eps = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    assert ((want.double() - exact).abs() <= eps * exact.abs() + 1e-5 * got.double().abs().amax()).all()
    q, k = got[:, :1].double(), got[:, 1:].double()
    qr, kr = want[:, :1].double(), want[:, 1:].double()
    assert torch.allclose((qr * kr).sum(-1), (q * k).sum(-1), rtol=4 * eps, atol=4 * eps * head_dim * 16)


def test_hadamard_refuses_what_it_cannot_rotate() -> None:
    for shape in [(2, 3, 48), (2, 3, 512)]:
        with pytest.raises(ValueError, match="power of two"):
            ops.hadamard_inplace(torch.zeros(shape))


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def to_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_reshape_and_cache_rounds_like_torch(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    kv_heads, head_dim, tokens = 3, 64, 70
    # NOTE: magnitudes from subnormal to beyond the format's range (saturated, never inf/NaN).
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) *
         torch.logspace(-6, 5, tokens)[:, None, None]).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.zeros(20, 16, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(320, generator=gen)[:tokens]
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    got_k = k_cache.view(-1, kv_heads, head_dim)[slots]
    got_v = v_cache.view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(got_k.view(torch.uint8), to_fp8(k, 0.5, cache_dtype).view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), to_fp8(v, 2.0, cache_dtype).view(torch.uint8))
    assert torch.isfinite(got_k.float()).all()


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlens", [[1, 1, 1, 1], [1, 4, 17, 40]])
def test_attention_over_fp8_pool_equals_dequantized_pool(cache_dtype: torch.dtype, dtype: torch.dtype,
                                                        qlens: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(qlens) + qlens[-1])
    lens, block_size, heads, kv_heads, head_dim = [9, 30, 17, 100], 16, 6, 2, 64
    k_scale, v_scale = 0.25, 0.5
    num_blocks = 16
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = to_fp8(k_pool, k_scale, cache_dtype), to_fp8(v_pool, v_scale, cache_dtype)
    k_deq, v_deq = (k_cache.float() * k_scale).to(dtype), (v_cache.float() * v_scale).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:7] for _ in lens])
    q = torch.randn(sum(qlens), heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *qlens]).cumsum(0)
    args = (tables, torch.tensor(lens), starts, head_dim**-0.5)
    got = ops.paged_attention(q, k_cache, v_cache, *args, 0, k_scale, v_scale).float()
    want = ops.paged_attention(q, k_deq, v_deq, *args, 0).float()
    assert ((got - want).abs() <= 2**-7 * (want.abs() + 1)).all()
