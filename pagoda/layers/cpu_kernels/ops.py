"""Python faces of the CPU kernels: shape checks, then one ctypes call each.

Every function takes CPU tensors of one dtype (fp32, bf16 or fp16; `gemv` bf16 only) whose
innermost dimension is contiguous; outer strides are passed through, so views (q/k/v split
from a fused projection) need no copy. Call only when `cpu_kernels.available()`.
NOTE: ctypes rather than torch custom ops: a call costs ~1 us here either way (measured:
8-argument ctypes call 1.2 us, `torch.ops.aten.add_` 1.9 us), and plain C needs no torch
headers, so the build takes seconds and one library serves every torch version.
"""

from __future__ import annotations

import ctypes

import torch

from pagoda.layers.cpu_kernels import checks, memory
from pagoda.layers.cpu_kernels.loader import KernelLibrary

# NOTE: set by `cpu_kernels.library()` / `use_variant()`; read here without an import or a
# call, since a decode step makes ~400 kernel calls.
LIB: KernelLibrary | None = None


def _lib() -> KernelLibrary:
    if LIB is None:
        from pagoda.layers.cpu_kernels import library

        if library() is None:
            raise RuntimeError("pagoda's CPU kernels are not available")
    assert LIB is not None
    return LIB


def _check_rows(x: torch.Tensor, inner: int) -> None:
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != inner):
        raise ValueError(f"rows must be contiguous inside (shape {tuple(x.shape)}, strides {x.stride()})")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    window: int = 0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its whole paged context.

    Args:
        q: [num_tokens, num_heads, head_dim]; sequence s owns rows
            query_start_loc[s]:query_start_loc[s + 1], the last rows of its context.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; q's
            dtype, or fp8 (e4m3fn/e5m2) holding K / k_scale and V / v_scale.
        block_tables: int64 [num_seqs, max_blocks]; seq_lens: int64 [num_seqs] (context
            lengths, new rows included); query_start_loc: int64 [num_seqs + 1].
        window: sliding window in tokens (0: none).
    Returns:
        [num_tokens, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_rows(q, head_dim)
    _, block_size, num_kv_heads, _ = k_cache.shape
    if checks.ENABLED:
        checks.paged(k_cache, block_tables, seq_lens, query_start_loc, num_tokens)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
    _lib().cache_fn("paged_attention", q.dtype, k_cache.dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads,
        head_dim, block_size, block_tables.shape[1], q.stride(0), num_heads * head_dim, scale, window,
        k_scale, v_scale)
    return out


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes token t's k[t], v[t] ([num_kv_heads, head_dim]) into slot slot_mapping[t] (< 0: skip).

    An fp8 pool stores k / k_scale and v / v_scale, rounded to nearest even and saturated.
    """
    _check_rows(k, k.shape[-1])
    _check_rows(v, v.shape[-1])
    if checks.ENABLED:
        checks.slots(slot_mapping, k.shape[0], k_cache)
    _lib().cache_fn("reshape_and_cache", k.dtype, k_cache.dtype)(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        k.shape[0], k.shape[1] * k.shape[2], k.stride(0), v.stride(0), k_scale, v_scale)


def rotary_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([num_tokens, num_heads, head_dim], heads may be strided) in place.

    cos, sin: fp32 [max_positions, head_dim] tables; positions: int64 [num_tokens].
    """
    if x.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous")
    num_tokens, num_heads, head_dim = x.shape
    if checks.ENABLED:
        checks.positions(positions, num_tokens, cos)
    _lib().fn("rotary", x.dtype)(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 num_tokens, num_heads, head_dim, x.stride(0), x.stride(1))


def hadamard_inplace(x: torch.Tensor) -> None:
    """Multiplies each head of x ([num_tokens, num_heads, head_dim], heads may be strided; head_dim a
    power of two up to 256) by the normalized Walsh-Hadamard matrix, in place."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"hadamard needs contiguous heads of a power of two up to 256, got {tuple(x.shape)}")
    _lib().fn("hadamard", x.dtype)(x.data_ptr(), num_tokens, num_heads, head_dim, x.stride(0), x.stride(1))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D fp32, bf16 or fp16 x (rows may be strided): the first maximum of
    each row, a NaN counting as the maximum (torch's rule), as int64 [rows]."""
    _check_rows(x, x.shape[-1])
    out = torch.empty(x.shape[0], dtype=torch.long)
    _lib().fn("argmax_rows", x.dtype)(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out


def philox_uniform(key: int, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] fp32 uniforms of the watermark's PRF (pagoda/watermark.py's
    `philox_uniform`, the same bits) for int64 contexts [rows, width]."""
    contexts = contexts.to(torch.int64).contiguous()
    out = torch.empty(contexts.shape[0], vocab_size, dtype=torch.float32)
    _lib().fn("philox_uniform")(key, contexts.data_ptr(), contexts.shape[0], contexts.shape[1],
                                        vocab_size, out.data_ptr())
    return out


def _temperatures(temps: torch.Tensor, kernel: str) -> torch.Tensor:
    """fp32, contiguous; every one positive (the sampling kernels divide by them)."""
    temps = temps.to(torch.float32).contiguous()
    if not bool((temps > 0).all()):
        raise ValueError(f"{kernel} takes positive temperatures")
    return temps


def top_candidates(x: torch.Tensor, temps: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of fp32 x [rows, n] (rows may be strided) divided by its temperature (`temps`
    [rows]): its `width` largest values, descending (ties: the lower index first), their int64
    indices, and the log-sum-exp of the whole divided row [rows] (-inf where no value is finite;
    NaN where the row holds a NaN, whose candidates are not set)."""
    _check_rows(x, x.shape[-1])
    rows, n = x.shape
    if x.dtype != torch.float32 or not 0 < width <= n:
        raise ValueError(f"top_candidates takes fp32 rows and 0 < width <= {n}, got {x.dtype} and {width}")
    temps = _temperatures(temps, "top_candidates")
    values = torch.empty(rows, width, dtype=torch.float32)
    index = torch.empty(rows, width, dtype=torch.long)
    lse = torch.empty(rows, dtype=torch.float32)
    _lib().fn("top_candidates")(x.data_ptr(), rows, n, x.stride(0), temps.data_ptr(), width, values.data_ptr(),
                                index.data_ptr(), lse.data_ptr())
    return values, index, lse


def draw_rows(x: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """A token per row of fp32 logits x [rows, n] (rows may be strided) at its temperature
    (`temps` [rows], positive), drawn by the inverse of its distribution at `uniforms` [rows]
    (float64 in [0, 1)): pagoda/sampler.py's `inverse_cdf` of softmax(x / t) in one call; never a
    token of probability 0; a row with a NaN or no finite logit gives its argmax."""
    _check_rows(x, x.shape[-1])
    rows, n = x.shape
    temps = _temperatures(temps, "draw_rows")
    uniforms = uniforms.to(torch.float64).contiguous()
    if x.dtype != torch.float32 or temps.shape != (rows,) or uniforms.shape != (rows,):
        raise ValueError(f"draw_rows takes fp32 rows and one temperature and uniform a row, got {x.dtype}, "
                         f"{tuple(temps.shape)}, {tuple(uniforms.shape)} for {rows} rows")
    out = torch.empty(rows, dtype=torch.long)
    _lib().fn("draw_rows")(x.data_ptr(), rows, n, x.stride(0), temps.data_ptr(), uniforms.data_ptr(), out.data_ptr())
    return out.tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm over the last dimension of a 2-D x (rows may be strided)."""
    return _norm("rms_norm", x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = RMSNorm(residual). Both contiguous [rows, n]."""
    _fused_add_norm("fused_add_rms_norm", x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dimension of a 2-D x (rows may be strided): x normalized,
    times `scale` (fp32 1 + weight), rounded once to x's dtype."""
    return _norm("gemma_rms_norm", x, scale, eps)


def fused_add_gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = Gemma's RMSNorm(residual). Both contiguous."""
    _fused_add_norm("fused_add_gemma_rms_norm", x, residual, scale, eps)


def _norm(name: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_rows(x, x.shape[-1])
    out = torch.empty_like(x)
    _lib().fn(name, x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                             x.stride(0), out.stride(0), eps)
    return out


def _fused_add_norm(name: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("x and residual must be contiguous")
    _lib().fn(name, x.dtype)(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for a contiguous [rows, 2n] x."""
    return _gated("silu_and_mul", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[:, :n], approximate='tanh') * x[:, n:] for a contiguous [rows, 2n] x (GeGLU)."""
    return _gated("gelu_tanh_and_mul", x)


def _gated(name: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    rows, n = x.numel() // x.shape[-1], x.shape[-1] // 2
    out = torch.empty(rows, n, dtype=x.dtype)
    _lib().fn(name, x.dtype)(x.data_ptr(), out.data_ptr(), rows, n)
    return out.view(x.shape[:-1] + (n,))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided) times weight [N, K]^T (+ bias): bf16, fp32 sums."""
    _check_rows(x, x.shape[-1])
    n, k = weight.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    _lib().fn("gemv_bf16")(x.data_ptr(), x.stride(0), weight.data_ptr(),
                           bias.data_ptr() if bias is not None else None, out.data_ptr(), n, x.shape[0], n, k)
    return out


class GemmWeight(ctypes.Structure):
    """How the GEMM sees a packed weight (pagoda/csrc/gemm.h's `GemmWeight`, field for field);
    each packed type below describes itself with one, which holds raw pointers into it."""

    _fields_ = [("kind", ctypes.c_int64), ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("group_size", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


BF16_PANELS, INT8_PANELS, INT4_PANELS, INT8_GROUP_PANELS = 0, 1, 2, 6
INT8_F32_GROUP_PANELS, INT8_F32_GROUP_OFFSET_PANELS, INT8_GROUP_NARROW_PANELS, INT5_PANELS = 7, 8, 9, 10
INT5_F32_PANELS, INT8_F32_GROUP_WIDE_PANELS, INT8_F32_GROUP_OFFSET_WIDE_PANELS = 11, 12, 13
F32_GROUP_KINDS = (INT8_F32_GROUP_PANELS, INT8_F32_GROUP_OFFSET_PANELS)
OFFSET_KINDS = (INT8_F32_GROUP_OFFSET_PANELS, INT8_F32_GROUP_OFFSET_WIDE_PANELS)


def describe(kind: int, data: torch.Tensor, scales: torch.Tensor | None, group_size: int, n: int,
             k: int) -> tuple[GemmWeight, int]:
    """(the descriptor, its address) of a packed weight whose tensors the caller keeps alive."""
    desc = GemmWeight(kind, data.data_ptr(), scales.data_ptr() if scales is not None else None, group_size, n, k)
    return desc, ctypes.addressof(desc)


class PackedWeight:
    """A bf16 weight [n, k] in the small-M GEMM's panel layout (see pagoda/csrc/gemm.cpp)."""

    kind = BF16_PANELS

    def __init__(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Packs `weight` into `out` (uint8, `packed_bytes` long: a slice of a bigger buffer) or
        into a tensor of its own."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.stride(-1) != 1 or not weight.numel():
            raise ValueError(f"expected a non-empty 2-D bf16 weight with contiguous rows, got {weight.dtype} "
                             f"{tuple(weight.shape)} strides {weight.stride()}")
        lib = _lib()
        self.n, self.k = weight.shape
        size = lib.fn("gemm_packed_size_bf16")(self.n, self.k)
        self.data = torch.zeros(size, dtype=torch.bfloat16) if out is None else out.view(torch.bfloat16).zero_()
        if self.data.numel() != size:
            raise ValueError(f"a packed [{self.n}, {self.k}] weight takes {2 * size} bytes, got {2 * self.data.numel()}")
        lib.fn("gemm_pack_bf16")(weight.data_ptr(), weight.stride(0), self.data.data_ptr(), self.n, self.k)
        self.scales: torch.Tensor | None = None
        self.group_size = 0
        self.desc, self.desc_ptr = describe(BF16_PANELS, self.data, None, 0, self.n, self.k)


def packed_bytes(n: int, k: int) -> int:
    """Bytes of a bf16 [n, k] weight in the GEMM's panel layout (`PackedWeight`)."""
    return 2 * int(_lib().fn("gemm_packed_size_bf16")(n, k))


def gemm_is_native() -> bool:
    """Whether `gemm` runs on native bf16 dot products (faster than oneDNN); elsewhere it is a
    plain fp32 loop, correct but slow, and layers keep their oneDNN/GEMV paths."""
    return _lib().variant == "avx512bf16"


def panels_are_native() -> bool:
    """Whether the GEMM multiplies integer panels (`Int8Panels`, `Int4Panels`) on vector
    integer products: int8 and int4 on avx512bf16 (vpdpbusd) and on avx2 (vpmaddubsw; faster
    than the records' GEMV at every row count on a Zen 3: docs/performance.md, "AVX2 int4" and
    "AVX2 int8"). The portable build's tiles are plain loops: its layers keep their records."""
    return _lib().variant in ("avx512bf16", "avx2")


def int8_narrow_tiles() -> bool:
    """Whether this build's int8 tiles take f16 groups of 32 of narrow codes ([-32, 31], stored
    + 32 and multiplied as unsigned bytes: GGUF's Q5_0; `Int8Panels`): the avx2 build (vpdpbusd
    takes them wide as Q8_0's)."""
    return bool(_lib().fn("gemm_int8_narrow")())


def int5_tiles() -> bool:
    """Whether this build's GEMM takes int5 panels (`Int4Panels` of codes in [0, 31]: int4's
    nibbles and a plane of fifth bits; GGUF's Q5_0): the avx512bf16 build."""
    return bool(_lib().fn("gemm_int5")())


def int8_f32_bias() -> int:
    """What the fp32-group kinds' stored codes add: 32 on the avx2 build (narrow codes only, in
    [-32, 31], as its vpmaddubsw sums them), 128 on avx512bf16 (any code: vpdpbusd's int32 sums)."""
    return int(_lib().fn("gemm_int8_f32_bias")())


def int8_f32_wide_tiles() -> bool:
    """Whether this build has wide fp32-group kinds apart from its narrow ones (codes in [-127,
    127] with fp32 scales, offsets or none: a layer mixing Q8_0 with offset kinds): the avx2
    build (avx512bf16's plain fp32-group kinds take any code: `int8_f32_bias`)."""
    return bool(_lib().fn("gemm_int8_f32_wide")())


def int8_f32_group_tiles() -> bool:
    """Whether this build's int8 tiles take codes with fp32 scales by groups of 16 or 32, offsets
    or none (GGUF's Q6_K, Q5_K, Q5_1 and layers mixing kinds; `Int8Panels`): the avx2 build
    (narrow codes only) and avx512bf16 (any)."""
    return bool(_lib().fn("gemm_int8_f32_groups")())


class Int8Panels:
    """int8 codes [n, k] in [-127, 127] in the small-M GEMM's panel layout (pagoda/csrc/gemm.cpp),
    scaled by one of:
    - one fp32 scale per output row (scales [n]): w = q * scale;
    - one f16 scale per row and group of 32 along k (scales [n, k / 32], values f16 holds
      exactly: GGUF's Q8_0 and Q5_0): w = q * scale (on the avx2 build, codes all in [-32, 31],
      Q5_0's, take the narrow kind: `int8_narrow_tiles`);
    - (`int8_f32_group_tiles`: the avx2 and avx512bf16 builds) fp32 scales d per row and group of 16 or 32 (scales
      [n, k / group]), with fp32 offsets m of the same shape or without: w = q * d + m (GGUF's
      Q6_K, Q5_K, Q5_1, and layers whose sources mix kinds), codes in [-32, 31] only on avx2.
    On the avx512bf16 and avx2 builds (`gemm_int8_format` 2) the codes are stored + 128 as
    uint8 (+ 32 for avx2's fp32-group kinds: `code_bias`), each panel of 32 rows by quads of k
    (row c's 4 codes of quad j at j * 128 + 4 c), group scales as f16 [panel][group][32 rows],
    or fp32 [panel][group][d, then m][32 rows]; on the portable one (0) as int8 in the bf16
    panels' layout (k-pairs), per-row scales only.
    `x_group(rows)`: the groups along k in which the GEMM rounds x of that many rows to int8
    codes (`packing.round_to_int8_groups`; the weight's own groups where it has them), 0 where it
    multiplies x as it is (the portable build; AMX tiles, `amx_at(rows)`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
        self.kind, self.group_size, refused = Int8Panels._classify(codes, scales, offsets)
        if refused is not None:
            raise ValueError(refused)
        self.n, self.k = codes.shape
        self.format = int(_lib().fn("gemm_int8_format")())
        self.width = 4 if self.format == 2 else 2  # k's of a row side by side
        cols, steps = -(-self.n // 32) * 32, -(-self.k // self.width)
        padded = torch.zeros(cols, self.width * steps, dtype=torch.int8)
        padded[:self.n, :self.k] = codes
        # NOTE: panel p, step j, row c, element e at p * 32 * width * steps + (j * 32 + c) * width + e.
        panels = padded.view(cols // 32, 32, steps, self.width).permute(0, 2, 1, 3).contiguous()
        if self.format == 2:
            panels = (panels.to(torch.int16) + self.code_bias).to(torch.uint8).view(torch.int8)
        self.data = panels.view(-1)
        if self.kind == INT8_PANELS:
            self.scales = scales.float().reshape(-1).contiguous()
        else:
            parts = [scales] if offsets is None else [scales, offsets]
            dtype = torch.float16 if self.kind in (INT8_GROUP_PANELS, INT8_GROUP_NARROW_PANELS) else torch.float32
            groups = torch.zeros(len(parts), cols, self.k // self.group_size, dtype=dtype)
            for i, part in enumerate(parts):
                groups[i, :self.n] = part
            # [part, panel, row, group] -> [panel, group, part, row]
            self.scales = groups.view(len(parts), cols // 32, 32, -1).permute(1, 3, 0, 2).contiguous().view(-1)
        self.desc, self.desc_ptr = describe(self.kind, self.data, self.scales, self.group_size, self.n, self.k)

    @staticmethod
    def refusal(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None) -> str | None:
        """Why these codes, scales (and offsets) cannot be int8 panels on this build (None: they can)."""
        return Int8Panels._classify(codes, scales, offsets)[2]

    @staticmethod
    def _classify(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
                  ) -> tuple[int, int, str | None]:
        """(the GEMM's kind, the group size along k (0: per row), why this build cannot take them
        or None) for these codes, scales and offsets; the codes' range read once."""
        grouped = offsets is not None or (scales.dim() == 2 and scales.shape[1] > 1)
        if (codes.dtype != torch.int8 or codes.dim() != 2 or not codes.numel() or scales.shape[0] != codes.shape[0]
                or (grouped and (scales.dim() != 2 or codes.shape[1] % scales.shape[1]))
                or (not grouped and scales.numel() != codes.shape[0])):
            return -1, 0, (f"expected int8 codes [n, k] and n scales (or [n, k / group]), got {codes.dtype} "
                           f"{tuple(codes.shape)} and scales {tuple(scales.shape)}")
        if offsets is not None and offsets.shape != scales.shape:
            return -1, 0, f"offsets {tuple(offsets.shape)} do not match the scales {tuple(scales.shape)}"
        low, high = (int(v) for v in torch.aminmax(codes))
        if low == -128:
            return -1, 0, "int8 panels take codes in [-127, 127] (symmetric quantization); -128 found"
        if not grouped:
            return INT8_PANELS, 0, None
        narrow = -32 <= low and high <= 31
        if int(_lib().fn("gemm_int8_format")()) != 2:
            return -1, 0, "int8 panels with group scales need the avx512bf16 or avx2 kernels (this build's format 0)"
        group = codes.shape[1] // scales.shape[1]
        if offsets is None and group == 32 and torch.equal(scales.to(torch.float16).float(), scales.float()):
            return (INT8_GROUP_NARROW_PANELS if narrow and int8_narrow_tiles() else INT8_GROUP_PANELS), 32, None
        kind = INT8_F32_GROUP_PANELS if offsets is None else INT8_F32_GROUP_OFFSET_PANELS
        if not int8_f32_group_tiles():
            return kind, group, ("int8 panels keep group scales as f16 on this build: these are not all f16 values"
                                 if group == 32 and offsets is None else
                                 "int8 panels with fp32 group scales (groups of 16, or offsets) need the avx2 or "
                                 "avx512bf16 kernels; this build keeps such weights as records")
        if group not in (16, 32):
            return kind, group, f"int8 panels take groups of 16 or 32 along k, not {group} (k {codes.shape[1]})"
        if not narrow and int8_f32_bias() == 32:
            if int8_f32_wide_tiles():  # NOTE: avx2: the wide kinds, slower than the narrow ones
                return (INT8_F32_GROUP_WIDE_PANELS if offsets is None else INT8_F32_GROUP_OFFSET_WIDE_PANELS), group, None
            return kind, group, (f"int8 panels with fp32 group scales take codes in [-32, 31] on this build (GGUF's "
                                 f"k-quants), these span [{low}, {high}]")
        return kind, group, None

    def amx_at(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on AMX tiles: the codes widened to bf16 (exact with
        per-row scales; with group scales each weight q * d (+ m) computed in fp32 and rounded once
        to bf16), x as it is."""
        return self.format == 2 and rows >= GEMM_AMX_INTEGER_ROWS[8] and self.k % 32 == 0

    def x_group(self, rows: int) -> int:
        return 0 if self.format != 2 or self.amx_at(rows) else (self.group_size or 32)

    def row_scales(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [n, G] scales (G = 1, or k / group with groups) of every row or of `rows`."""
        return self._group_part(0, rows)

    @property
    def code_bias(self) -> int:
        """What the stored codes add (format 2): 32 for the narrow kinds' codes in [-32, 31]
        (Q5_0's on the avx2 build, and its fp32-group kinds: multiplied as unsigned bytes with no
        sign moved onto x; `int8_f32_bias`), 128 for the others."""
        if self.kind == INT8_GROUP_NARROW_PANELS:
            return 32
        return int8_f32_bias() if self.kind in F32_GROUP_KINDS else 128

    @property
    def has_offsets(self) -> bool:
        return self.kind in OFFSET_KINDS

    def row_offsets(self, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """fp32 [n, G] offsets m of every row or of `rows` (None: the panels have none)."""
        return self._group_part(1, rows) if self.has_offsets else None

    def _group_part(self, part: int, rows: torch.Tensor | None) -> torch.Tensor:
        ids = torch.arange(self.n) if rows is None else rows.reshape(-1)
        if not self.group_size:
            return self.scales[ids][:, None]
        parts = 2 if self.kind in OFFSET_KINDS else 1
        return self.scales.view(-1, self.k // self.group_size, parts, 32)[ids // 32, :, part, ids % 32].float()

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 codes [n, k] (or of `rows`), back in row order; reads only those rows."""
        steps = -(-self.k // self.width)
        ids = torch.arange(self.n) if rows is None else rows.reshape(-1)
        k = torch.arange(self.k)
        index = ((ids // 32) * 32 * self.width * steps + (ids % 32) * self.width)[:, None] + (
            (k // self.width) * 32 * self.width + k % self.width)[None, :]
        # NOTE: index_select on the flat index: advanced indexing of this 1-D tensor by a 2-D index
        # took 7.7 ms for 16 rows of Gemma 3's 262144 x 640 embedding (0.4 ms so).
        picked = self.data.index_select(0, index.reshape(-1)).view(index.shape)
        if self.format == 2:
            picked = (picked.view(torch.uint8).to(torch.int16) - self.code_bias).to(torch.int8)
        return picked


class Int4Panels:
    """int4 codes q [n, k] in [0, 15] with f16 scales d and offsets m per group of `group_size`
    along k (w = q * d + m), in the small-M GEMM's panel layout (pagoda/csrc/gemm.cpp): per panel
    of 32 rows and two k-pairs, 64 bytes (byte 2(2c + e) + h: row c's code at k-pair h, element
    e, in the low nibble, row 16 + c's in the high one); per panel and group, d for its 32 rows
    then m. The GEMM rounds x to int8 codes by the same groups (`x_group`), but on AMX tiles
    (`amx_at`).
    Codes in [0, 31] with m = -16 d (`int5_tiles` builds only: GGUF's Q5_0, w = (q - 16) d, 5
    bits a weight where int8 codes take 8) make int5 panels: the low nibbles so, then per panel
    and those 64 bytes two 64-bit masks (block 0's, block 1's), bit j the fifth bit of the code
    in nibble j of that block; per panel and group d alone (m implied); the integer products
    take the offset exactly (the same bits as `Int8Panels` of q - 16).
    `fp32_scales` (int5 only: GGUF's Q5_K and Q5_1, codes q in [0, 31], w = q * d + m with d, m
    that f16 cannot hold): d and m kept fp32 per panel and group, [d 32, m 32] (the same bits as
    `Int8Panels` of q with those fp32 scales and offsets)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int,
                 fp32_scales: bool = False) -> None:
        n, k = q.shape
        if k % group_size or group_size % 16 or d.shape != (n, k // group_size) or m.shape != d.shape:
            raise ValueError(f"int4 codes {tuple(q.shape)}, scales {tuple(d.shape)}, offsets {tuple(m.shape)} "
                             f"do not fit groups of {group_size}")
        if fp32_scales and not int5_tiles():
            raise ValueError("int5 panels with fp32 scales need the avx512bf16 kernels")
        top = int(q.max()) if q.numel() else 0
        if top > 31 or (top > 15 and not int5_tiles()):
            raise ValueError(f"int4 panels take codes in [0, 15] (in [0, 31] where this build has int5 panels), "
                             f"got a code of {top}")
        if top > 15 and not fp32_scales and not torch.equal(m.to(torch.float16), (-16 * d.float()).to(torch.float16)):
            raise ValueError("int5 panels with f16 scales take offsets m = -16 d (GGUF's Q5_0) only")
        self.kind = INT5_F32_PANELS if fp32_scales else INT5_PANELS if top > 15 else INT4_PANELS
        self.n, self.k, self.group_size = n, k, group_size
        cols, groups = -(-n // 32) * 32, k // group_size
        padded = torch.zeros(cols, k, dtype=torch.uint8)
        padded[:n] = q
        # [panel, block, column c, k-pair pair, k-pair within, element e] -> byte (pair, c, e,
        # within), the block its nibble.
        blocks = padded.view(cols // 32, 2, 16, k // 4, 2, 2).permute(0, 3, 2, 5, 4, 1).reshape(cols // 32, k // 4, 64, 2)
        nibbles = ((blocks[..., 0] & 15) | ((blocks[..., 1] & 15) << 4)).contiguous().view(-1)
        if self.kind in (INT5_PANELS, INT5_F32_PANELS):
            # [panel, pair, byte j, block] -> [panel, pair, block, 8 bytes of 8 bits], bit j of the mask
            bits = (blocks >> 4).permute(0, 1, 3, 2).reshape(cols // 32, k // 4, 2, 8, 8).to(torch.int32)
            high = (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
            nibbles = torch.cat([nibbles, high.view(-1)])
        self.data = nibbles
        parts = 1 if self.kind == INT5_PANELS else 2  # NOTE: int5's m = -16 d, not stored
        dm = torch.zeros(parts, cols, groups, dtype=torch.float32 if fp32_scales else torch.float16)
        dm[0, :n] = d
        if parts == 2:
            dm[1, :n] = m
        self.scales = dm.view(parts, cols // 32, 32, groups).permute(1, 3, 0, 2).contiguous().view(-1)
        self.desc, self.desc_ptr = describe(self.kind, self.data, self.scales, group_size, n, k)

    @property
    def has_offsets(self) -> bool:
        """Whether the panels hold offsets of their own (int5 with fp32 scales: Q5_K's, Q5_1's)."""
        return self.kind == INT5_F32_PANELS

    def amx_at(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on AMX tiles: the weight widened to bf16 (q * d +
        m rounded once), x as it is."""
        return rows >= GEMM_AMX_INTEGER_ROWS[4] and self.k % 32 == 0

    def x_group(self, rows: int) -> int:
        return 0 if self.amx_at(rows) else self.group_size

    def unpack(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [rows, k], d f16 [rows, G], m f16 [rows, G]; fp32 d, m with `fp32_scales`) of
        every row or of `rows`."""
        ids = torch.arange(self.n) if rows is None else rows.reshape(-1)
        groups = self.k // self.group_size
        # NOTE: byte (panel, j, c, h, e) of the [panel][k / 4][16][2][2] layout, row c's codes at k-pair
        # 2j + h, element e, gathered as [row, j, e, h] through index_select (as `Int8Panels.codes`).
        j = torch.arange(self.k // 4).view(1, -1, 1, 1)
        e = torch.arange(2).view(1, 1, -1, 1)
        h = torch.arange(2).view(1, 1, 1, -1)
        index = ((ids // 32) * (self.k // 4) * 64 + (ids % 16) * 4).view(-1, 1, 1, 1) + j * 64 + h * 2 + e
        blocks = self.data.index_select(0, index.reshape(-1)).view(index.shape)
        q = torch.where((ids % 32 < 16)[:, None, None, None], blocks & 15, blocks >> 4)
        if self.kind in (INT5_PANELS, INT5_F32_PANELS):
            # NOTE: the nibble's byte in its step (as `index` reads it) is its bit in the block's mask
            bit = ((ids % 16) * 4).view(-1, 1, 1, 1) + h * 2 + e
            at = (-(-self.n // 32) * 32 * self.k // 2 + (ids // 32) * (self.k // 4) * 16
                  + (ids % 32 // 16) * 8).view(-1, 1, 1, 1) + j * 16 + bit // 8
            q = q | (((self.data.index_select(0, at.reshape(-1)).view(at.shape) >> (bit % 8)) & 1) << 4)
        q = q.reshape(len(ids), self.k)
        if self.kind == INT5_PANELS:
            d = self.scales.view(-1, groups, 32)[ids // 32, :, ids % 32]
            return q, d, -16 * d
        dm = self.scales.view(-1, groups, 2, 32)[ids // 32, :, :, ids % 32]
        return q, dm[:, :, 0], dm[:, :, 1]


def gather_in_huge_pages(weights: list[PackedWeight | Int8Panels | Int4Panels]) -> None:
    """Moves the weights' tensors, in order, into one huge-page buffer (`memory`), each weight's
    descriptor pointing at its new place; the old copies are freed once nothing else holds them."""
    tensors = [t for w in weights for t in (w.data, w.scales) if t is not None]
    moved = iter(memory.gather_in_huge_pages(tensors))
    for w in weights:
        w.data = next(moved)
        if w.scales is not None:
            w.scales = next(moved)
        w.desc, w.desc_ptr = describe(w.kind, w.data, w.scales, w.group_size, w.n, w.k)


def gemm(x: torch.Tensor, weight: PackedWeight | Int8Panels | Int4Panels | Records,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 (rows may be strided) times a packed weight^T (+ bias): exact bf16 products
    of x and the weight (bf16 values or int8 codes), fp32 sums, scaled per column (int8; with
    group scales, per column and group of 32), rounded once to bf16; int8 on vpdpbusd and
    vpmaddubsw multiplies x rounded to int8 codes by groups of 32 (`Int8Panels.x_group`). int4:
    x rounded to int8 codes per row and group first (step max |x| / 127, as
    llama.cpp's Q8_0 activations), integer products and sums per group, then scaled per column
    and group in fp32 (the offsets through the rounded x's group sums). `Records`: as `qgemv`."""
    _check_rows(x, x.shape[-1])
    m, k = x.shape
    if k != weight.k or x.dtype != torch.bfloat16:
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} against a packed weight [{weight.n}, {weight.k}]")
    out = torch.empty(m, weight.n, dtype=x.dtype)
    _lib().fn("gemm_packed")(weight.desc_ptr, x.data_ptr(), x.stride(0),
                             bias.data_ptr() if bias is not None else None, out.data_ptr(), weight.n, m)
    return out


# A gated MLP's activations (pagoda/csrc/gemm.h's `GatedAct`).
GATED_ACTS = {"silu": 1, "gelu_tanh": 2}


def panel_rows(weight: Int8Panels | Int4Panels, rows: torch.Tensor) -> torch.Tensor | None:
    """bf16 [len(rows), k]: those rows of an integer panel weight dequantized as packing's torch
    reference does (w = q * d (+ m) in fp32, rounded once), in one native call (an embedding read
    from a tied, packed LM head); None where the build does not take the weight (the caller
    dequantizes in torch)."""
    ids = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.k, dtype=torch.bfloat16)
    done = int(_lib().fn("gemm_rows_bf16")(weight.desc_ptr, ids.data_ptr(), ids.numel(), out.data_ptr()))
    if done < 0:
        raise IndexError(f"a row id outside [0, {weight.n}) of a packed [{weight.n}, {weight.k}] weight")
    return out if done else None


def gemm_gated(x: torch.Tensor, weight: PackedWeight | Int8Panels | Int4Panels, act: str,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """act(x . Wg^T) * (x . Wu^T) for a gate/up weight [Wg; Wu] in one product, the same bits as
    `gemm` followed by `silu_and_mul` / `gelu_tanh_and_mul` (`act` 'silu' or 'gelu_tanh');
    None where the GEMM cannot fuse them (only its AMX passes do; the decoder stack then runs
    the two kernels)."""
    _check_rows(x, x.shape[-1])
    m, k = x.shape
    if k != weight.k or x.dtype != torch.bfloat16 or weight.n % 2:
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} against a packed gate/up weight [{weight.n}, {weight.k}]")
    out = torch.empty(m, weight.n // 2, dtype=x.dtype)
    done = _lib().fn("gemm_packed_gated")(weight.desc_ptr, x.data_ptr(), x.stride(0),
                                          bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                          weight.n // 2, m, GATED_ACTS[act])
    return out if done else None


# Packed weight formats of `qgemv` / `dequantize` (csrc/qgemv.cpp describes the records).
INT4, INT8 = 0, 1
INT8_RECORDS, INT4_RECORDS, INT8_F16_RECORDS = 3, 4, 5  # their GemmWeight kinds (gemm.h)


class Records:
    """`qgemv`'s records of a layer as a GemmWeight, so that `gemm` and the decoder stack take
    them (bf16 activations; steps of up to `max_rows` rows, where the GEMV beats dequantizing)."""

    max_rows = 16

    def __init__(self, packed: torch.Tensor, fmt: int, in_features: int, group_size: int) -> None:
        if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
            raise ValueError(f"expected contiguous uint8 records, got {packed.dtype} {tuple(packed.shape)}")
        f16_scales = fmt == INT8 and packed.shape[1] == in_features + 2 * (in_features // group_size)
        self.kind = INT4_RECORDS if fmt == INT4 else INT8_F16_RECORDS if f16_scales else INT8_RECORDS
        self.data, self.scales = packed, None
        self.n, self.k = packed.shape[0], in_features
        self.desc, self.desc_ptr = describe(self.kind, packed, None, group_size, self.n, in_features)


def qgemv(x: torch.Tensor, packed: torch.Tensor, fmt: int, in_features: int, group_size: int,
          bias: torch.Tensor | None = None, max_threads: int = 1 << 30) -> torch.Tensor:
    """x [M, K] (rows may be strided; f32, bf16 or f16) times a packed weight [N, record]^T.

    Args:
        packed: uint8 [N, row_bytes], one record per output row (`INT4` or `INT8` layout).
        in_features: K; group_size: elements of K per scale (K for one scale a row).
    """
    _check_rows(x, x.shape[-1])
    n = packed.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    _lib().fn("qgemv", x.dtype)(fmt, x.data_ptr(), x.stride(0), packed.data_ptr(), packed.shape[1], group_size,
                                bias.data_ptr() if bias is not None else None, out.data_ptr(), n,
                                x.shape[0], n, in_features, max_threads)
    return out


def qgemv_x_group(in_features: int, group_size: int) -> int:
    """The groups along K by which `qgemv` rounds x to int8 codes (the AVX2 build: integer
    products for int8 and int4 records, as llama.cpp's AVX2 dot products), or 0 where it
    multiplies x as it is (bf16 for int4 records, fp32 for int8)."""
    return int(_lib().fn("qgemv_x_group")(in_features, group_size))


def dequantize(packed: torch.Tensor, fmt: int, in_features: int, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of a packed one, in `dtype` (each value rounded once)."""
    n = packed.shape[0]
    out = torch.empty(n, in_features, dtype=dtype)
    _lib().fn("dequantize", dtype)(fmt, packed.data_ptr(), packed.shape[1], group_size, out.data_ptr(), n,
                                   in_features)
    return out


# NOTE: the row count from which the bf16 GEMM runs its FMA tiles (gemm_tiles.py; set at load),
# part of the kernel plan's cache key: the GEMM's timings depend on it.
GEMM_FMA_ROWS = 1 << 62


def set_gemm_fma_rows(rows: int) -> int:
    """Steps of at least `rows` rows multiply bf16 panels on fp32 FMAs (the avx512bf16 build) or on
    chunks widened to fp32 (the avx2 build; the portable one has one tile kind and ignores it);
    returns `rows`."""
    global GEMM_FMA_ROWS
    if _lib().fn("gemm_set_fma_rows")(rows):
        GEMM_FMA_ROWS = rows
    return rows


# NOTE: likewise the row count from which one tile prefetches its weight stream (gemm_tiles.py).
DEFAULT_PREFETCH_ROWS = 6  # gemm.cpp's kPrefetchRows
GEMM_PREFETCH_ROWS = DEFAULT_PREFETCH_ROWS


def set_gemm_prefetch_rows(rows: int) -> int:
    """Steps of at least `rows` rows (one tile) prefetch the weight stream ahead; returns `rows`."""
    global GEMM_PREFETCH_ROWS
    _lib().fn("gemm_set_prefetch_rows")(rows)
    GEMM_PREFETCH_ROWS = rows
    return rows


# NOTE: likewise the row count from which it runs on AMX tiles (gemm_tiles.py), where the CPU has them.
GEMM_AMX_ROWS = 1 << 62


def set_gemm_amx_rows(rows: int) -> bool:
    """Steps of at least `rows` rows multiply bf16 panels on AMX tiles (K a multiple of 32);
    False (and never AMX: the mirror too, whatever an earlier library set) where this CPU or
    build has none."""
    global GEMM_AMX_ROWS
    granted = bool(_lib().fn("gemm_set_amx_rows")(rows))
    GEMM_AMX_ROWS = rows if granted else 1 << 62
    return granted


# NOTE: likewise for int8 (8) and int4 (4) panels, which AMX multiplies widened to bf16 (x as it is).
GEMM_AMX_INTEGER_ROWS = {8: 1 << 62, 4: 1 << 62}


def set_gemm_amx_integer_rows(bits: int, rows: int) -> bool:
    """Steps of at least `rows` rows multiply int8 (`bits` 8) or int4 (4) panels on AMX tiles (K
    a multiple of 32), x as it is; False (and never AMX: the mirror too, whatever an earlier
    library set; e.g. the avx2 build on an AMX CPU) where this CPU or build has none."""
    granted = bool(_lib().fn("gemm_set_amx_integer_rows")(bits, rows))
    GEMM_AMX_INTEGER_ROWS[bits] = rows if granted else 1 << 62
    return granted


def set_num_threads(n: int) -> None:
    """Threads the kernels split their work over (independent of torch's current setting)."""
    _lib().fn("set_num_threads")(n)
