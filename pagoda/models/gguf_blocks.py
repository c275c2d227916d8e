"""GGUF block layouts decoded in torch: a tensor's raw blocks -> integer codes and group scales.

Every kind decoded here stores, per group of 32 (16 for Q6_K) consecutive weights of a row,
integer codes q and a scale d (and, for some kinds, an offset m), with w = q * d (+ m):

| kind | bytes / weights | codes | scale d (fp32) | offset m (fp32) |
|---|---|---|---|---|
| Q4_0 | 18 / 32 | q - 8 in [-8, 7] | block d (f16) | - |
| Q4_1 | 20 / 32 | q in [0, 15] | block d (f16) | block m (f16) |
| Q5_0 | 22 / 32 | q - 16 in [-16, 15] | block d (f16) | - |
| Q5_1 | 24 / 32 | q in [0, 31] | block d (f16) | block m (f16) |
| Q8_0 | 34 / 32 | int8 | block d (f16) | - |
| Q4_K | 144 / 256 | q in [0, 15] | d * sc (f16 x 6 bits) | -(dmin * mn) (f16 x 6 bits) |
| Q5_K | 176 / 256 | q in [0, 31] | d * sc | -(dmin * mn) |
| Q6_K | 210 / 256 | q - 32 in [-32, 31], groups of 16 | d * sc (f16 x int8) | - |

The k-quants pack 8 (Q6_K: 16) sub-blocks into a super-block of 256 with one f16 d (and dmin);
Q4_K/Q5_K's sub-block scales sc and mins mn are 6 bits, packed 8 + 8 in 12 bytes. The codes
are exact in int8 and the fp32 scales and offsets exact products (11-bit mantissa times at
most 8 bits), so `Blocks.dequantize` computes the `gguf` package's formulas (`gguf.quants`)
with the same fp32 operations in the same order: the same bits (tests/test_quantization.py).
Everything is whole-tensor torch arithmetic: no loop over blocks or rows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256
# bytes per block, and weights per block
BLOCK_BYTES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
               "Q4_K": (144, QK_K), "Q5_K": (176, QK_K), "Q6_K": (210, QK_K)}
DECODED_KINDS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class Blocks:
    """A tensor's weights as w = codes * scale (+ offset) per group along each row.

    Attributes:
        codes: int8 [rows, cols].
        scale: fp32 [rows, cols / group_size].
        offset: fp32 like `scale`, or None (no offset).
        group_size: 32, or 16 (Q6_K).
        code_range: the codes' range for this kind (lowest, highest).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    code_range: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]: `gguf`'s values, bit for bit."""
        rows, cols = self.codes.shape
        w = self.codes.float().view(rows, -1, self.group_size) * self.scale[..., None]
        if self.offset is not None:
            w += self.offset[..., None]
        return w.view(rows, cols)


def decode(raw: np.ndarray, kind: str, rows: int) -> Blocks:
    """A tensor's raw blocks (as the file holds them, [rows, bytes a row]) -> `Blocks`."""
    size, _ = BLOCK_BYTES[kind]
    with warnings.catch_warnings():
        # NOTE: a read-only view of the mapped file: only read here, never written.
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size))
    codes, scale, offset, group, code_range = _DECODERS[kind](blocks)
    return Blocks(codes.reshape(rows, -1), scale.reshape(rows, -1),
                  None if offset is None else offset.reshape(rows, -1), group, code_range)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., b] bytes -> [n, ..., 2, b]: the low nibbles, then the high ones."""
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def _bits(qh: torch.Tensor, width: int, step: int) -> torch.Tensor:
    """[n, ..., b] bytes -> [n, ..., 8 // step, b]: fields of `width` bits at shifts 0, step, ..."""
    shifts = torch.arange(0, 8, step, dtype=torch.uint8).view(-1, 1)
    return (qh.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


_Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, tuple[int, int]]


def _q4_0(b: torch.Tensor) -> _Decoded:
    q = _nibbles(b[:, 2:]).view(-1, 32).to(torch.int8) - 8
    return q, _f16(b[:, :2]), None, 32, (-8, 7)


def _q4_1(b: torch.Tensor) -> _Decoded:
    q = _nibbles(b[:, 4:]).view(-1, 32).to(torch.int8)
    return q, _f16(b[:, :2]), _f16(b[:, 2:4]), 32, (0, 15)


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 codes: bit i of the little-endian 32-bit qh is element i's fifth bit."""
    high = _bits(qh, 1, 1).transpose(-1, -2).reshape(-1, 32)
    return (_nibbles(qs).view(-1, 32) | (high << 4)).to(torch.int8)


def _q5_0(b: torch.Tensor) -> _Decoded:
    return _q5(b[:, 2:6], b[:, 6:]) - 16, _f16(b[:, :2]), None, 32, (-16, 15)


def _q5_1(b: torch.Tensor) -> _Decoded:
    return _q5(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 32, (0, 31)


def _q8_0(b: torch.Tensor) -> _Decoded:
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None, 32, (-128, 127)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins,
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: each sub-block's scale d * sc and offset -(dmin * mn), fp32 [n, 8]."""
    sc, mn = _scale_min_k4(b[:, 4:16])
    return _f16(b[:, :2]) * sc.float(), -(_f16(b[:, 2:4]) * mn.float())


def _q4_k(b: torch.Tensor) -> _Decoded:
    # 4 chunks of 32 bytes: sub-block 2c in chunk c's low nibbles, 2c + 1 in its high ones
    q = _nibbles(b[:, 16:].view(-1, 4, 32)).reshape(-1, QK_K).to(torch.int8)
    return (q, *_k_scales(b), 32, (0, 15))


def _q5_k(b: torch.Tensor) -> _Decoded:
    low = _nibbles(b[:, 48:].view(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 1, 1)  # bit j of qh byte i: sub-block j's element i
    q = (low | (high << 4)).reshape(-1, QK_K).to(torch.int8)
    return (q, *_k_scales(b), 32, (0, 31))


def _q6_k(b: torch.Tensor) -> _Decoded:
    # two halves of 128: 64 ql bytes (low nibbles, then high) and 32 qh bytes (2 bits, 4 shifts)
    low = _nibbles(b[:, :128].view(-1, 2, 64)).reshape(-1, 8, 32)
    high = _bits(b[:, 128:192].view(-1, 2, 32), 2, 2).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.int8).reshape(-1, QK_K) - 32
    scale = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    return q, scale, None, 16, (-32, 31)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
