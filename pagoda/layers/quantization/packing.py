"""Packed weight formats and their torch reference: quantize, pack, unpack, dequantize.

One record per output row (see csrc/qgemv.cpp), so that the native kernels read one
sequential stream per row and a tensor-parallel shard or a gathered embedding row is a plain
row slice:
- int4: [K/2 bytes of nibbles][G x f16 scale d][G x f16 offset m], w = q * d + m with q in
  [0, 15] and groups of `group_size` along K; K must be a multiple of 64. The nibbles are in
  the kernel's stream order (`stream_order`, csrc/qgemv.cpp says why): stream position
  64c + p (p < 32) is the low nibble of byte 32c + p, position 64c + 32 + p its high nibble.
- int8: [K x int8][G x f32 scale d], w = q * d with q in [-127, 127] (G = 1: per channel).
Where the native GEMM runs (avx512bf16), int8 per-channel and int4 layers trade these records
for its panel layout at load (`PackedLinearMethod.use_gemm`, cpu_kernels.ops.Int8Panels and
Int4Panels). Dequantizing computes q * d, then + m, in fp32, and rounds once to the target dtype: the
same operations, in the same order, as the native `dequantize` kernel.
"""

from __future__ import annotations

import functools

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def int4_row_bytes(in_features: int, group_size: int) -> int:
    return in_features // 2 + 4 * (in_features // group_size)


def int8_row_bytes(in_features: int, group_size: int) -> int:
    return in_features + 4 * (in_features // group_size)


def int4_group_size(in_features: int, requested: int) -> int | None:
    """The largest supported group size up to `requested` that divides in_features (None when
    in_features is not a multiple of 64, which the packed layout needs)."""
    if in_features % 64:
        return None
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if g <= requested and in_features % g == 0), None)


def check_int4_shape(in_features: int, group_size: int) -> str | None:
    """Why a K x group size cannot be packed as int4 (None when it can)."""
    if group_size not in INT4_GROUP_SIZES:
        return f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}"
    if in_features % 64 or in_features % group_size:
        return f"in_features {in_features} is not a multiple of 64 and of the group size {group_size}"
    return None


@functools.cache
def _stream_order(in_features: int) -> tuple[int, ...]:
    blocks, superblocks, b0 = in_features // 32, [], 0
    for size in (16, 8, 4, 2):
        while blocks >= size:
            superblocks.append((size, b0))
            blocks, b0 = blocks - size, b0 + size
    order = []
    for size, first in superblocks:
        lanes = 16 // size
        for t in range(size // 2):
            for half in (0, 1):
                for p in range(32):
                    j, u = divmod(p // 2, lanes)
                    order.append(32 * (first + j) + (t * lanes + u) * 4 + 2 * half + (p & 1))
    return tuple(order)


def stream_order(in_features: int) -> torch.Tensor:
    """The element of K held at each stream position of an int4 row (csrc/qgemv.cpp): K in
    32-element blocks, blocks in superblocks of 16, 8, 4 or 2, each of vdpbf16ps's 16 lanes
    summing elements of one block only."""
    return torch.tensor(_stream_order(in_features), dtype=torch.long)


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q: integers in [0, 15], [N, K]; d, m: [N, G] (stored as f16) -> uint8 records."""
    n, k = q.shape
    q8 = q.to(torch.uint8)[:, stream_order(k).to(q.device)].view(n, k // 64, 2, 32)
    nibbles = (q8[:, :, 0] | (q8[:, :, 1] << 4)).reshape(n, k // 2)
    scales = torch.cat([d.to(torch.float16), m.to(torch.float16)], dim=1).contiguous().view(torch.uint8)
    return torch.cat([nibbles, scales], dim=1).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int, group_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 records -> (q uint8 [N, K], d f16 [N, G], m f16 [N, G])."""
    n, k, g = packed.shape[0], in_features, in_features // group_size
    nibbles = packed[:, : k // 2].reshape(n, k // 64, 1, 32)
    stream = torch.cat([nibbles & 15, nibbles >> 4], dim=2).reshape(n, k)
    q = torch.empty_like(stream)
    q[:, stream_order(k).to(packed.device)] = stream
    scales = packed[:, k // 2:].contiguous().view(torch.float16)
    return q, scales[:, :g], scales[:, g:]


def dequantize_int4(packed: torch.Tensor, in_features: int, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    q, d, m = unpack_int4(packed, in_features, group_size)
    n, g = d.shape
    w = q.view(n, g, group_size).float() * d.float()[..., None] + m.float()[..., None]
    return w.reshape(n, in_features).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest asymmetric int4 per group: d = (max - min) / 15, m = min (both f16)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    d = ((high - low) / 15).to(torch.float16)
    m = low.to(torch.float16)
    safe = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round((groups - m.float()[..., None]) / safe[..., None]).clamp(0, 15)
    return pack_int4(q.reshape(n, k), d, m)


def round_to_int8_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] as the GEMM's int4 and int8 panels multiply it (`x_group`): per row and group
    along K (the last one may be shorter), x * (127 / max |x|) rounded half to even, in fp32 as
    the kernel computes it, times max |x| / 127 (the kernel's torch reference)."""
    m, k = x.shape
    groups = torch.nn.functional.pad(x.float(), (0, -k % group_size)).reshape(m, -1, group_size)
    top = groups.abs().amax(-1, keepdim=True)
    # NOTE: through float64: torch's fp32 `127 / top` is not always correctly rounded (one ulp
    # off made x * inv 63.499996 where the kernel's IEEE quotient gives 63.500004).
    inv = torch.where(top > 0, (127 / top.double()).float(), torch.zeros_like(top))
    return (torch.round(groups * inv) * (top / 127)).reshape(m, -1)[:, :k]


# NOTE: the most f16 group scales a row may have (qgemv.cpp's kMaxF16Scales).
MAX_F16_SCALES = 4096


def pack_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q: integers in [-128, 127], [N, K]; d: [N, G] -> uint8 records: [K codes][G scales] a row,
    the scales in f16 where f16 holds every one exactly (GGUF's Q8_0 and Q5_0, whose scales are
    f16: 1/9 fewer bytes a weight in groups of 32), else in fp32."""
    d = d.float().contiguous()
    half = d.half()
    exact = d.shape[1] <= MAX_F16_SCALES and bool(torch.equal(half.float(), d))
    scales = (half if exact else d).view(torch.uint8)
    return torch.cat([q.to(torch.int8).view(torch.uint8), scales], dim=1).contiguous()


def unpack_int8(packed: torch.Tensor, in_features: int, group_size: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 records -> (q int8 [N, K], d fp32 [N, G]); G = K / group_size (default 1), whose
    width tells f16 scales from fp32 ones."""
    groups = in_features // (group_size or in_features)
    scales = packed[:, in_features:].contiguous()
    if scales.shape[1] == 2 * groups:
        return packed[:, :in_features].view(torch.int8), scales.view(torch.float16).float()
    return packed[:, :in_features].view(torch.int8), scales.view(torch.float32)


def dequantize_int8(packed: torch.Tensor, in_features: int, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    q, d = unpack_int8(packed, in_features, group_size)
    n, g = d.shape
    w = q.reshape(n, g, group_size).float() * d[..., None]
    return w.reshape(n, in_features).to(dtype)


def quantize_int8(w: torch.Tensor, group_size: int | None = None, amax: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Round-to-nearest symmetric int8: d = max|w| / 127 per output channel (or per group).

    Args:
        amax: max|w| per channel [N, 1] when the row holds only part of it (a row-parallel
            shard: the group's maximum, so that every rank's codes are the whole model's).
    """
    n, k = w.shape
    gs = group_size or k
    groups = w.float().reshape(n, k // gs, gs)
    d = (groups.abs().amax(dim=-1) if amax is None else amax.float().reshape(n, -1)) / 127
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(groups / safe[..., None]).clamp(-127, 127)
    return pack_int8(q.reshape(n, k), d)
