"""The native CPU kernels against plain torch references, for both compiled variants.

Tolerances: fp32 results match the reference to 1e-5 (only the summation order differs);
bf16/fp16 results are the fp32 reference's value rounded once, so they may differ from it by
one rounding of the output (2^-8 relative for bf16, 2^-11 for fp16) plus fp32 summation noise;
elementwise kernels that round where torch rounds (rotary, the residual add) must be exact.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers import cpu_kernels
from pagoda.layers.activation import GeluAndMul
from pagoda.layers.cpu_kernels import ops
from pagoda.layers.cpu_kernels.build import VARIANTS

pytestmark = pytest.mark.skipif(bool(os.environ.get("PAGODA_DISABLE_CPU_KERNELS")),
                                reason="PAGODA_DISABLE_CPU_KERNELS is set")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture(params=sorted(VARIANTS), autouse=True)
def variant(request: pytest.FixtureRequest):
    lib = cpu_kernels.use_variant(request.param)
    if lib is None:
        pytest.skip(f"{request.param} kernels unavailable")
    yield request.param
    cpu_kernels.use_variant(None)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """|got - want| <= tol * (|want| + 1): one output rounding plus summation noise."""
    err = (got.float() - want.float()).abs() / (want.float().abs() + 1)
    assert err.max().item() <= TOL[dtype], f"max scaled error {err.max().item():.3g}"


# ---------------------------------------------------------------- greedy sampling

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 262144])
def test_argmax_rows_equals_torch(dtype: torch.dtype, n: int) -> None:
    """Each row's first maximum; a NaN counts as the maximum (torch's rule): ties, -inf rows,
    NaN before and after the largest value and in a row's tail, rows strided."""
    gen = torch.Generator().manual_seed(n)
    base = torch.randn(9, n + 7, generator=gen).to(dtype)
    x = base[:, :n]
    x[1] = x[1].round()
    x[2] = float("-inf")
    x[3, n // 2] = float("nan")
    x[4, -1] = float("nan")
    x[5, 0] = 100.0
    x[5, n // 3] = float("nan")
    x[6] = 1.0
    x[7, -1] = 100.0
    x[8, n // 2:] = float("nan")
    base[:, n:] = 1000.0  # NOTE: past each row's end: never read
    assert torch.equal(ops.argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("n,width", [(1, 1), (17, 16), (300, 256), (4000, 256), (49152, 256), (49152, 7)])
def test_top_candidates_equal_torchs_topk_and_logsumexp(n: int, width: int) -> None:
    """Each row's `width` largest values of x / t (descending, the lower index first among equal
    values) and their indices equal torch's topk of the divided row where values are distinct, the
    log-sum-exp within 1e-5; rows strided, a row in ascending order (the buffer's worst case),
    ties, fewer finite values than `width` (the first -inf positions fill the rest), an all -inf
    row (those positions, lse -inf) and a NaN row (lse NaN)."""
    gen = torch.Generator().manual_seed(n + width)
    base = torch.randn(8, n + 5, generator=gen) * 4
    x = base[:, :n]
    x[1] = torch.arange(n, dtype=torch.float32) / n
    x[2] = (x[2] * 2).round()
    x[3, width // 2:] = float("-inf")
    x[4, n // 2] = float("nan")
    x[5] = float("-inf")
    x[6, 1:] = float("-inf")
    temps = torch.rand(8, generator=gen) * 2 + 0.1
    values, index, lse = ops.top_candidates(x, temps, width)
    scaled = x / temps[:, None]
    assert torch.isnan(lse[4]) and lse[5] == float("-inf")
    for r in (0, 1, 2, 3, 6, 7):
        row = scaled[r]
        order = sorted(range(n), key=lambda i: (-row[i].item(), i))[:width]
        assert index[r].tolist() == order, r
        assert torch.equal(values[r], row[order]), r
        assert torch.allclose(lse[r], row.logsumexp(-1), rtol=1e-5, atol=1e-5, equal_nan=False) or lse[r] == row.logsumexp(-1), r
    for r in (0, 7):  # NOTE: distinct random values: torch's own topk
        want_values, want_index = scaled[r].topk(width)
        assert torch.equal(values[r], want_values) and torch.equal(index[r], want_index)
    with pytest.raises(ValueError, match="positive temperatures"):
        ops.top_candidates(x, torch.zeros(8), width)


@pytest.mark.parametrize("n", [1, 17, 1024, 1025, 49152, 262144])
def test_draw_rows_equal_the_samplers_inverse_cdf(n: int) -> None:
    """The kernel's draws are the sampler's `inverse_cdf` of softmax(x / t) at the same uniforms
    (rows strided, masked -inf tokens, ties, peaked and flat rows, uniforms near 0 and 1), never a
    token of probability 0 (a row masked but for a few tokens, whatever the uniform), and a NaN
    row's or an all -inf row's argmax (torch's rule)."""
    from pagoda.sampler import inverse_cdf

    gen = torch.Generator().manual_seed(n)
    rows = 12
    base = torch.randn(rows, n + 3, generator=gen) * torch.tensor([4.0, 1.0, 0.1] * 4)[:, None]
    x = base[:, :n]
    x[3, ::3] = float("-inf")
    x[4] = x[4].round()
    x[5] = float("-inf")
    x[5, [0, n // 2, n - 1]] = torch.tensor([1.0, 0.5, 2.0])
    temps = torch.rand(rows, generator=gen) * 1.5 + 0.2
    finite = [r for r in range(rows) if torch.isfinite(x[r]).any()]
    for uniforms in (torch.rand(rows, generator=gen, dtype=torch.float64),
                     torch.tensor([0.0, 0.25, 0.5, 0.75] * 3, dtype=torch.float64)):
        got = ops.draw_rows(x, temps, uniforms)
        want = inverse_cdf((x / temps[:, None]).softmax(dim=-1), uniforms)
        assert got == want, [(r, g, w) for r, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    # NOTE: at the ends the two may part by a token whose interval is below rounding; both valid
    for u in (1e-300, 1 - 2**-53):
        got = ops.draw_rows(x, temps, torch.full((rows,), u, dtype=torch.float64))
        assert all(x[r, got[r]] > float("-inf") for r in finite)
    odd = x[:2].clone()
    odd[0, n // 2] = float("nan")
    odd[1] = float("-inf")
    assert ops.draw_rows(odd, temps[:2], torch.tensor([0.3, 0.3], dtype=torch.float64)) == [n // 2, 0]


# ---------------------------------------------------------------- paged attention

def make_pool(lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              gen: torch.Generator):
    """A NaN-filled pool with each sequence's K/V in shuffled blocks; returns pool, tables, dense K/V."""
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    dense = []
    for s, n in enumerate(lens):
        ids = [order.pop() for _ in range(blocks[s])]
        tables[s, :len(ids)] = torch.tensor(ids)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(n):
            k_cache[ids[pos // block_size], pos % block_size] = k[pos]
            v_cache[ids[pos // block_size], pos % block_size] = v[pos]
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """q [n, H, D] are the last n rows of a context of len(k); causal (+ window) softmax in fp32."""
    n, heads, d = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    qpos = torch.arange(length - n, length)[:, None]
    kpos = torch.arange(length)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    scores = (qf @ kf.transpose(1, 2)) / math.sqrt(d)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).reshape(n, heads * d)


def run_attention(lens: list[int], qlens: list[int], block_size: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, window: int = 0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, dense = make_pool(lens, block_size, kv_heads, head_dim, dtype, gen)
    # NOTE: q is a strided view (as split from a fused qkv projection), never copied.
    fused = torch.randn(sum(qlens), heads * head_dim + 7, generator=gen).to(dtype)
    q = fused[:, :heads * head_dim].view(-1, heads, head_dim)
    starts = torch.tensor([0] + qlens).cumsum(0)
    got = ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, head_dim**-0.5, window)
    for s, (k, v) in enumerate(dense):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        assert_close(got[rows], reference_attention(q[rows], k, v, window), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_across_block_boundaries(block_size: int, dtype: torch.dtype, tile_kind: str) -> None:
    # NOTE: tile_kind: decode's P.V runs on bf16 pairs where the GEMM's choice is vdpbf16ps, on
    # fp32 FMAs otherwise; blocks of 8 and odd lengths give tiles of an odd number of keys.
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    run_attention(lens, [1] * len(lens), block_size, heads=9, kv_heads=3, head_dim=64, dtype=dtype)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 192, 256])
def test_decode_gqa_ratios_and_head_dims(heads: int, kv_heads: int, head_dim: int) -> None:
    run_attention([5, 40, 77], [1, 1, 1], 16, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 1, 7, 33])
def test_several_query_rows_causal_and_window(dtype: torch.dtype, window: int) -> None:
    # NOTE: query lengths 1 (decode), 4 (a verified draft), 17 and 40 (prefill chunks that
    # continue a cached context, crossing the 16-row query tile).
    run_attention([9, 30, 17, 100], [1, 4, 17, 40], 16, 6, 2, 64, dtype, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 100, 300])
def test_decode_across_score_chunks(dtype: torch.dtype, window: int, tile_kind: str) -> None:
    # NOTE: a decode item scores up to 256 keys (whole tiles) before their softmax: contexts
    # just under, at and over one and several chunks, blocks of 16 and 24 keys (tiles short of
    # 16 inside a chunk), windows that end inside a chunk or span two.
    lens = [255, 256, 257, 520, 700]
    run_attention(lens, [1, 1, 3, 2, 1], 16, 9, 3, 64, dtype, window)
    run_attention(lens, [1, 2, 1, 1, 4], 24, 8, 2, 128, dtype, window, seed=window + 1)


@pytest.fixture(params=["dpbf16", "fma", "amx"])
def tile_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The GEMM's measured tile choice, which bf16 prefill attention follows: vdpbf16ps on bf16
    pairs (Q.K and P.V), fp32 FMAs, or AMX tiles (where the CPU has them); restored after.
    Other builds have FMAs only."""
    fma_before, amx_before = ops.GEMM_FMA_ROWS, ops.GEMM_AMX_ROWS
    if request.param != "dpbf16" and cpu_kernels.library().variant != "avx512bf16":
        pytest.skip("only the avx512bf16 build has several tile kinds")
    ops.set_gemm_fma_rows(1 if request.param == "fma" else 1 << 62)
    if not ops.set_gemm_amx_rows(1 if request.param == "amx" else 1 << 62) and request.param == "amx":
        pytest.skip("this CPU has no AMX tiles (amx_bf16), or Linux refused the tile data")
    yield request.param
    ops.set_gemm_fma_rows(fma_before)
    ops.set_gemm_amx_rows(amx_before)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 80), (16, 2, 128),
                                                     (4, 2, 96), (2, 2, 256), (4, 4, 72)])
@pytest.mark.parametrize("window", [0, 21])
def test_prefill_chunks_over_cached_prefixes(heads: int, kv_heads: int, head_dim: int, window: int,
                                             tile_kind: str) -> None:
    # NOTE: tiles of 16+ query vectors (rows x GQA group) take the prefill path (scores as a
    # small GEMM, softmax down the lanes); decodes in the same call keep the decode path.
    # Cached prefixes of 0-50 tokens end on, before and after block edges (block 16), so key
    # tiles of odd length (a zero key pads the last bf16 pair); chunks of 5-70 rows end
    # mid-tile; head_dim 80 and 96 are 4 + 1 and 4 + 2 chunks of 16 lanes, 72 not whole chunks
    # (FMAs throughout).
    cached, chunk = [0, 15, 16, 17, 50, 9], [16, 70, 33, 5, 40, 1]
    lens = [c + n for c, n in zip(cached, chunk, strict=True)]
    run_attention(lens, chunk, 16, heads, kv_heads, head_dim, torch.bfloat16, window, seed=head_dim + window)


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", [0, 150])
def test_prefill_over_prefixes_longer_than_a_span(block_size: int, window: int, tile_kind: str) -> None:
    # NOTE: AMX takes keys in spans of up to 128 (several key tiles, one softmax): prefixes of
    # 130-300 keys give several spans, a window's first tile starts mid-block, and blocks of 8
    # keys make every tile short (copied into zeroed rows); the running max moves across spans.
    cached, chunk = [130, 300, 257], [40, 17, 200]
    lens = [c + n for c, n in zip(cached, chunk, strict=True)]
    run_attention(lens, chunk, block_size, 9, 3, 64, torch.bfloat16, window, seed=block_size + window)
    run_attention(lens, chunk, block_size, 8, 2, 128, torch.bfloat16, window, seed=1 + block_size + window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_tiles_in_fp32_and_fp16(dtype: torch.dtype) -> None:
    run_attention([100, 64], [100, 31], 16, 9, 3, 64, dtype, window=0, seed=5)


def test_single_long_sequence_uses_every_row() -> None:
    run_attention([1000], [1], 32, 9, 3, 64, torch.bfloat16, window=0, seed=3)


@pytest.mark.parametrize("lens", [[2100, 1900], [600] * 9])
def test_work_split_over_threads(lens: list[int]) -> None:
    # NOTE: enough K/V rows to leave the calling thread: two long sequences split over KV
    # heads; nine sequences take all KV heads per item.
    ops.set_num_threads(2)
    try:
        run_attention(lens, [1] * len(lens), 16, 9, 3, 64, torch.bfloat16, seed=len(lens))
        run_attention(lens, [3] * len(lens), 16, 9, 3, 64, torch.float32, window=300, seed=1)
    finally:
        ops.set_num_threads(torch.get_num_threads())


# ---------------------------------------------------------------- K/V write, rotary

@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, tokens = 3, 64, 70
    qkv = torch.randn(tokens, (3 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, 3 * head_dim:(3 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (3 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    k_cache = torch.zeros(20, 16, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(320, generator=gen)[:tokens]
    slots[5] = -1
    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    want_k, want_v = torch.zeros_like(k_cache).view(-1, kv_heads, head_dim), torch.zeros_like(v_cache).view(-1, kv_heads, head_dim)
    want_k[slots[keep]], want_v[slots[keep]] = k[keep], v[keep]
    assert torch.equal(k_cache.view_as(want_k), want_k) and torch.equal(v_cache.view_as(want_v), want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_rounds_like_hf(dtype: torch.dtype) -> None:
    from pagoda.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(2)
    head_dim, heads = 64, 5
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0, 512)
    positions = torch.randint(0, 512, (13,), generator=gen)
    fused = torch.randn(13, heads * head_dim + 3, generator=gen).to(dtype)
    x = fused[:, :heads * head_dim].view(13, heads, head_dim)
    cos, sin = rope.cos[positions].to(dtype)[:, None], rope.sin[positions].to(dtype)[:, None]
    want = apply_rotary(x.clone(), cos, sin)
    ops.rotary_inplace(x, positions, rope.cos, rope.sin)
    assert torch.equal(x, want)


# ---------------------------------------------------------------- norms, activation, GEMV

def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (37, 200)])
def test_rms_norm_and_fused_add(dtype: torch.dtype, rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n, generator=gen).to(dtype)
    residual = torch.randn(rows, n, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    assert_close(ops.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), dtype)
    want_residual = x + residual
    want = hf_rms_norm(want_residual, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_residual)
    assert_close(x, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 640), (3, 256), (9, 100)])
def test_gemma_rms_norm_and_fused_add_equal_the_module(dtype: torch.dtype, rows: int, n: int) -> None:
    """Gemma's (1 + w) norm: the kernel against the module's torch path (Hugging Face's), on
    strided rows and q/k heads [T, H, D] too; the fused form updates the residual in place."""
    from pagoda.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = GemmaRMSNorm(n, 1e-6)
    norm.weight.data = 0.3 * torch.randn(n, generator=gen)
    x = torch.randn(rows, 2 * n, generator=gen).to(dtype)[:, :n]  # NOTE: strided rows
    heads = torch.randn(rows, 3, n, generator=gen).to(dtype)
    residual = torch.randn(rows, n, generator=gen).to(dtype)

    def torch_path(t: torch.Tensor) -> torch.Tensor:
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + norm.weight.float())).to(t.dtype)

    assert_close(ops.gemma_rms_norm(x, norm.scale(), 1e-6), torch_path(x), dtype)
    assert_close(norm(heads), torch_path(heads), dtype)
    y = x.contiguous()
    want_residual = y + residual
    want = torch_path(want_residual)
    got, got_residual = norm.forward_with_residual(y, residual)
    assert got is y and got_residual is residual and torch.equal(residual, want_residual)
    assert_close(got, want, dtype)
    norm.weight.data = torch.zeros(n)  # NOTE: a new weight remakes the scale
    assert torch.equal(norm.scale(), torch.ones(n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (3 * torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(4))).to(dtype)
    gate, up = x.chunk(2, -1)
    assert_close(ops.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    """Gemma's GeGLU: torch's tanh GELU of the gate (rounded to the dtype) times up, over a
    width with a tail, gates up to +-30 (saturating both ways) and a NaN kept NaN."""
    x = (3 * torch.randn(9, 2 * 1043, generator=torch.Generator().manual_seed(5))).to(dtype)
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, float("nan")], dtype=dtype)
    gate, up = x.chunk(2, -1)
    got, want = ops.gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up
    assert torch.isnan(got[0, 3]) and torch.isnan(want[0, 3])
    got[0, 3] = want[0, 3] = 0
    assert_close(got, want, dtype)
    if dtype != torch.float32:
        # NOTE: where torch's 1 + tanh(u) does not cancel (gates above -3.5) the same values,
        # rounding ties aside; below, torch's are inexact (under 1e-4 in size), the kernel's not.
        above = gate > -3.5
        assert (got == want)[above].float().mean() > 0.99
    act = GeluAndMul("tanh")
    assert torch.equal(act(x)[1:], got[1:])  # the module takes the kernel


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11])
@pytest.mark.parametrize("n,k,bias", [(576, 576, False), (963, 1536, True), (40, 70, False)])
def test_gemv_matches_fp32_linear(m: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * n)
    base = torch.randn(m, k + 5, generator=gen).to(torch.bfloat16)
    x = base[:, :k]
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert_close(ops.gemv(x, w, b), want, torch.bfloat16)


# ---------------------------------------------------------------- small-M GEMM (packed weights)

def gemm_case(m: int, n: int, k: int, bias: bool, seed: int):
    """Strided bf16 rows (NaN just past each row's K), a scaled weight, and the fp32 reference."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.full((m, k + 3), float("nan")).to(torch.bfloat16)
    base[:, :k] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x = base[:, :k]
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    return x, w, b, want


# M covers one tile (1..12 rows, with and without prefetch), several tiles over K chunks, and
# wide tiles (96+); N and K cover SmolLM2's shapes, partial panels and blocks, odd K.
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 11, 12, 13, 25, 64, 96, 101])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, True), (40, 70, False), (77, 129, True),
                                      (16, 2, False), (33, 1, True)])
def test_gemm_matches_fp32_linear(m: int, n: int, k: int, bias: bool) -> None:
    x, w, b, want = gemm_case(m, n, k, bias, seed=m * 1000 + n + k)
    assert_close(ops.gemm(x, ops.PackedWeight(w), b), want, torch.bfloat16)


def test_gemm_random_shapes() -> None:
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        m, n, k = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (81, 300, 300))
        x, w, b, want = gemm_case(m, n, k, trial % 2 == 1, seed=trial)
        assert_close(ops.gemm(x, ops.PackedWeight(w), b), want, torch.bfloat16)


def test_gemm_more_rows_than_one_pass() -> None:
    x, w, b, want = gemm_case(800, 48, 40, True, seed=3)
    assert_close(ops.gemm(x, ops.PackedWeight(w), b), want, torch.bfloat16)


def test_gemm_over_x_too_big_to_widen_at_once() -> None:
    # NOTE: on the avx2 build x is widened to fp32 once per call up to 2^21 floats; 700 rows of
    # 3,000 take the per-chunk widening instead.
    x, w, b, want = gemm_case(700, 40, 3000, False, seed=5)
    assert_close(ops.gemm(x, ops.PackedWeight(w), b), want, torch.bfloat16)


@pytest.fixture(params=["dpbf16", "fma", "amx"])
def gemm_tile_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bf16 GEMM on one tile kind from one row, the load-time choice restored after: the
    avx512bf16 build's vdpbf16ps and fp32 FMA tiles, and AMX tiles where the CPU has them; the
    avx2 build's register tiles ("dpbf16") and its tiles on widened chunks ("fma")."""
    fma_before, amx_before = ops.GEMM_FMA_ROWS, ops.GEMM_AMX_ROWS
    variant = cpu_kernels.library().variant if cpu_kernels.available() else None
    if variant not in ("avx512bf16", "avx2") or variant == "avx2" and request.param == "amx":
        pytest.skip("only the avx512bf16 and avx2 builds have several tile kinds (AMX: avx512bf16)")
    ops.set_gemm_fma_rows(1 if request.param == "fma" else 1 << 62)
    if not ops.set_gemm_amx_rows(1 if request.param == "amx" else 1 << 62) and request.param == "amx":
        pytest.skip("this CPU has no AMX tiles (amx_bf16), or Linux refused the tile data")
    yield request.param
    ops.set_gemm_fma_rows(fma_before)
    ops.set_gemm_amx_rows(amx_before)


def test_gemm_on_each_tile_kind_matches_fp32_linear(gemm_tile_kind: str) -> None:
    # NOTE: one tile (1-12 rows, with and without prefetch), several tiles over K chunks, wide
    # tiles (96+), odd K, partial panels, NaN past each row's K (gemm_case), strided rows. AMX:
    # one row tile (1-16 rows), two (17-32), several blocks with a short last one (33, 101), the
    # next panel prefetched (4+ blocks, 2+ panels a thread: 101 x 160, 600 x 96), passes of 512
    # rows (600, 800); K not a multiple of 32 keeps the vector tiles.
    for m, n, k, bias in [(1, 960, 576, False), (5, 77, 129, True), (6, 576, 1536, True), (12, 40, 70, False),
                          (13, 33, 1, True), (16, 64, 64, False), (17, 100, 96, True), (32, 33, 32, False),
                          (33, 960, 576, True), (64, 960, 576, True), (101, 77, 129, False), (101, 77, 160, True),
                          (600, 200, 96, True), (800, 48, 40, True), (800, 40, 64, False)]:
        x, w, b, want = gemm_case(m, n, k, bias, seed=m * 7 + n + k)
        assert_close(ops.gemm(x, ops.PackedWeight(w), b), want, torch.bfloat16)


def test_avx2_tile_kinds_give_bit_equal_outputs(gemm_tile_kind: str) -> None:
    # NOTE: gemm_tiles.BUILDS takes the faster avx2 kind at no margin because of this: both add
    # each row's products in k order into fp32 FMAs (one row tile, several, odd K, 800 rows; the
    # first tile over a chunk, which widens it, of 1 to 5 rows).
    if cpu_kernels.library().variant != "avx2" or gemm_tile_kind != "fma":
        pytest.skip("the avx2 build's two kinds, compared once")
    for m, n, k in [(1, 64, 96), (2, 40, 300), (6, 70, 200), (12, 96, 130), (16, 960, 576), (37, 100, 131),
                    (300, 576, 1536), (800, 48, 40)]:
        x, w, b, _ = gemm_case(m, n, k, True, seed=m + n + k)
        packed = ops.PackedWeight(w)
        widened = ops.gemm(x, packed, b)
        ops.set_gemm_fma_rows(1 << 62)
        assert torch.equal(ops.gemm(x, packed, b), widened)
        ops.set_gemm_fma_rows(1)


def test_gemm_refuses_mismatched_inputs() -> None:
    w = ops.PackedWeight(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(4, 63).to(torch.bfloat16), w)
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(4, 64), w)
    with pytest.raises(ValueError):
        ops.PackedWeight(torch.randn(32, 64))


def test_linear_prepacked_for_its_kernel(variant: str) -> None:
    """Native GEMM: one packed copy serves every row count; portable: oneDNN + the plain weight."""
    from torch import nn

    from pagoda.layers.linear import Linear, prepack_for_cpu

    gen = torch.Generator().manual_seed(11)
    model = nn.ModuleList([Linear(70, 45, bias=True), Linear(64, 96)]).to(torch.bfloat16)
    for layer in model:
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) / 8)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    plain = [layer.weight.detach().clone() for layer in model]
    kept = model[1].weight
    packed = prepack_for_cpu(model, keep={id(kept)})
    native = ops.gemm_is_native()
    assert native == (variant == "avx512bf16")
    if native:
        assert packed == 2 and all(layer.method.gemm_weight is not None for layer in model)
        assert model[0].weight.numel() == 0 and kept.numel() == 96 * 64
        # NOTE: both packed weights in one huge-page buffer, in module order, descriptors moved too
        first, second = (layer.method.gemm_weight for layer in model)
        assert first.data.untyped_storage().data_ptr() == second.data.untyped_storage().data_ptr()
        assert first.data.data_ptr() % (2 << 20) == 0
        assert second.data.data_ptr() == first.data.data_ptr() + -(-first.data.numel() * 2 // 64) * 64
        assert [layer.method.gemm_weight.desc.data for layer in model] == [first.data.data_ptr(), second.data.data_ptr()]
    for layer, w in zip(model, plain, strict=True):
        for m in (1, 2, 4, 16, 100):
            x = torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16)
            b = layer.bias.float() if layer.bias is not None else None
            assert_close(layer(x), F.linear(x.float(), w.float(), b), torch.bfloat16)
