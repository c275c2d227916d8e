"""Quantized linear methods: what a `Linear` holds in place of its float weight.

A method owns its packed tensors and computes `x W^T + bias` from them (`apply`). A `Linear`
calls `self.method.apply(self, x, bias)`; the kernel path runs where the CPU kernels take x
(`cpu_kernels.takes`). Every method also has a pure-torch path
(dequantize, then `F.linear`) that runs on any device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagoda.layers import cpu_kernels
from pagoda.layers.quantization import packing

if TYPE_CHECKING:
    from torch import nn

# NOTE: a step of at most this many rows runs the packed records through the native GEMV
# (each weight read once per 8 rows, unpacked in registers); a larger one dequantizes the
# layer to a dense matrix for oneDNN, whose blocked product wins once the unpacking is
# amortized over enough rows (docs/performance.md, Quantized weights). Layers repacked for the
# GEMM (`use_gemm`: int8 per channel, int4) run every bf16 step through it instead; measured
# over SmolLM2's weights (docs/benchmarks/quantization/qgemv_stream.py) it beats the GEMV from
# 1 row on, by 3x from 8 rows.
NATIVE_MAX_ROWS = 16
# NOTE: where the GEMV multiplies integers (the avx2 build: x rounded to int8 codes, `x_group`),
# it runs steps of up to this many rows too: the dense fallback dequantizes the layer to fp32
# every step (no native bf16 there). Gemma 3's five layer shapes in their GGUF records on a
# Zen 3 (docs/benchmarks/quantization/records_rows.py; docs/performance.md, "GGUF k-quants
# kept packed"): the GEMV 2-4x faster at 32 rows, 1.3x at 128, ahead at 256 (38.1 against
# 41.8 ms summed) and behind at 512 (72.0 against 69.4).
INTEGER_GEMV_MAX_ROWS = 256


@functools.cache
def _mkldnn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_matmul_is_fast(device: torch.device) -> bool:
    """Whether torch multiplies bf16 matrices natively here. NOTE: where it does not (an AVX2
    CPU), a dequantized product runs in fp32 instead: exact bf16 inputs, fp32 sums, one
    rounding, and about 5x faster than torch's bf16 fallback on a Zen 3."""
    return device.type != "cpu" or _mkldnn_bf16()


def _int5_panels(q: torch.Tensor, d: torch.Tensor, offsets: torch.Tensor | None, group_size: int
                 ) -> cpu_kernels.ops.Int4Panels | None:
    """Grouped int8 codes that fit in 5 bits as int5 panels, 5 bits a weight: q in [-16, 15] with
    f16 d and no offsets (w = q * d: GGUF's Q5_0) as q + 16 with m = -16 d, f16 d alone; q in
    [0, 31] with offsets (w = q * d + m: Q5_K, Q5_1) as q with fp32 d and m. None where the build
    has no int5 panels, groups are not of 32, or the codes or scales do not fit."""
    if not cpu_kernels.ops.int5_tiles() or group_size != 32 or q.shape[1] % 32:
        return None
    low, high = (int(v) for v in torch.aminmax(q))
    if offsets is not None:
        if low < 0 or high > 31:
            return None
        return cpu_kernels.ops.Int4Panels(q.to(torch.uint8), d.float(), offsets.float(), group_size, fp32_scales=True)
    d16, m16 = d.to(torch.float16), (-16 * d.float()).to(torch.float16)
    if low < -16 or high > 15 or not (torch.equal(d16.float(), d.float()) and torch.equal(m16.float(), -16 * d.float())):
        return None
    return cpu_kernels.ops.Int4Panels((q.to(torch.int16) + 16).to(torch.uint8), d16, m16, group_size)


class PackedLinearMethod:
    """int4 or int8 records (packing.py) for one `Linear`, or the GEMM's panels of them.

    Attributes:
        scheme: 'int4' or 'int8'.
        packed: uint8 [out_features, record bytes]; None once repacked into `panels`.
        panels: the codes in the small-M GEMM's layout (`use_gemm`), or None.
        offsets: int8 only: fp32 [out_features, groups] offsets m, w = q * d + m, added outside
            the kernel (GGUF's Q5_K and Q5_1, layers/quantization/gguf.py), or None.
    """

    def __init__(self, scheme: str, packed: torch.Tensor, in_features: int, group_size: int,
                 offsets: torch.Tensor | None = None) -> None:
        self.scheme = scheme
        self.packed: torch.Tensor | None = packed
        self.offsets = offsets
        self.panels: cpu_kernels.ops.Int8Panels | cpu_kernels.ops.Int4Panels | None = None
        self._records: cpu_kernels.ops.Records | None = None
        self.in_features = in_features
        self.group_size = group_size
        self.fmt = cpu_kernels.ops.INT4 if scheme == "int4" else cpu_kernels.ops.INT8

    @property
    def name(self) -> str:
        per = "channel" if self.group_size == self.in_features else f"group {self.group_size}"
        offsets = self.offsets is not None or getattr(self.panels, "has_offsets", False)
        int5 = (cpu_kernels.ops.INT5_PANELS, cpu_kernels.ops.INT5_F32_PANELS)
        scheme = "int5" if getattr(self.panels, "kind", None) in int5 else self.scheme
        return f"{scheme} ({per}{', offsets' if offsets else ''})"

    def use_gemm(self) -> bool:
        """Repacks the records into the GEMM's panels, the only copy kept, where this build's GEMM
        multiplies them natively (`ops.panels_are_native`: the avx512bf16 and avx2 builds; the
        caller checks that activations are bf16). Returns whether this layer has panels: int4,
        int8 per channel, int8 by groups of 32 whose scales are f16 values (GGUF's Q8_0 and Q5_0),
        and on the avx2 build int8 by groups of 16 or 32 with fp32 scales, offsets (which the
        panels then hold) or none (Q6_K, Q5_K, Q5_1, mixed layers); elsewhere those keep their
        records. Grouped int8 codes of 5 bits (GGUF's Q5_0, Q5_K, Q5_1) become int5 panels where
        the build has them (`_int5_panels`)."""
        if self.packed is None:
            return self.panels is not None
        if not cpu_kernels.ops.panels_are_native():
            return False
        if self.scheme == "int4":
            q, d, m = packing.unpack_int4(self.packed, self.in_features, self.group_size)
            self.panels = cpu_kernels.ops.Int4Panels(q, d, m, self.group_size)
        elif self.group_size == self.in_features and self.offsets is None:
            q, d = packing.unpack_int8(self.packed, self.in_features)
            self.panels = cpu_kernels.ops.Int8Panels(q, d)
        else:
            q, d = packing.unpack_int8(self.packed, self.in_features, self.group_size)
            self.panels = _int5_panels(q, d, self.offsets, self.group_size)
            if self.panels is None:
                if cpu_kernels.ops.Int8Panels.refusal(q, d, self.offsets) is not None:
                    return False
                self.panels = cpu_kernels.ops.Int8Panels(q, d, self.offsets)
            self.offsets = None  # NOTE: the panels hold them now (`row_offsets`, or int5's m)
        self.packed = None
        return True

    def native_weight(self) -> cpu_kernels.ops.Int8Panels | cpu_kernels.ops.Int4Panels | cpu_kernels.ops.Records | None:
        """What the native GEMM and decoder stack multiply by (bf16 activations): the panels, or
        the records as they are (steps of up to `Records.max_rows`); None without the kernels,
        or with offsets outside the records (which the native products would leave out)."""
        if self.panels is not None:
            return self.panels
        if self.offsets is not None:
            return None
        if self.packed is None or self.packed.device.type != "cpu" or not cpu_kernels.available():
            return None
        if self._records is None or self._records.data is not self.packed:
            self._records = cpu_kernels.ops.Records(self.packed, self.fmt, self.in_features, self.group_size)
        return self._records

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.offsets is None:
            return self._product(layer, x, bias)
        # NOTE: the records' product and the offsets' (x's group sums times m, a [G, N] product:
        # 1/group of the records' work) added in fp32, rounded once to x's dtype.
        y = self._product(layer, x.float(), None if bias is None else bias.float())
        sums = x.float().unflatten(-1, (-1, self.group_size)).sum(-1)
        return torch.addmm(y, sums, self.offsets.t()).to(x.dtype)

    def _product(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times the records (or panels) alone, offsets aside."""
        if self.panels is not None and x.dtype == torch.bfloat16:
            return cpu_kernels.ops.gemm(x, self.panels, bias)
        rows, native = x.shape[0], cpu_kernels.takes(x)
        if self.packed is not None and native and (
                rows <= NATIVE_MAX_ROWS or (rows <= INTEGER_GEMV_MAX_ROWS and self._gemv_x_group())):
            return cpu_kernels.ops.qgemv(x, self.packed, self.fmt, self.in_features, self.group_size, bias)
        dtype = torch.float32 if x.dtype == torch.bfloat16 and not bf16_matmul_is_fast(x.device) else x.dtype
        x_group = self._gemv_x_group() if native else 0
        # NOTE: this path rounds x as the GEMV multiplies it, so that a step's size never changes
        # a result beyond summation order: to int8 codes by groups (the AVX2 build, in fp32,
        # exact) or to bf16 (int4 on vdpbf16ps). (The GEMM's panels, which take every step where
        # they exist, round x to int8 codes themselves.)
        if x_group:
            xin = packing.round_to_int8_groups(x, x_group).to(dtype)
        elif self.scheme == "int4" and x.dtype != torch.bfloat16:
            xin = x.to(torch.bfloat16).to(dtype)
        else:
            xin = x.to(dtype)
        w = self._dequantize_records(dtype, native)
        return F.linear(xin, w, None if bias is None else bias.to(dtype)).to(x.dtype)

    def _gemv_x_group(self) -> int:
        """The groups by which the native GEMV rounds x to int8 codes for these records (0: none)."""
        if self.packed is None or self.packed.device.type != "cpu" or not cpu_kernels.available():
            return 0
        return cpu_kernels.ops.qgemv_x_group(self.in_features, self.group_size)

    def dequantize(self, dtype: torch.dtype, native: bool = False, rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The dense weight (or its `rows`) in `dtype`, by the kernel when `native`; with offsets,
        q * d + m in fp32 (`gguf`'s operations) rounded once to `dtype`."""
        if self.offsets is None:
            return self._dequantize_records(dtype, native, rows)
        w = self._dequantize_records(torch.float32, native, rows)
        m = self.offsets if rows is None else self.offsets[rows]
        return (w.unflatten(-1, (-1, self.group_size)) + m[..., None]).flatten(-2).to(dtype)

    def _dequantize_records(self, dtype: torch.dtype, native: bool = False, rows: torch.Tensor | None = None
                            ) -> torch.Tensor:
        if self.panels is not None:
            if rows is not None and dtype == torch.bfloat16:  # NOTE: an embedding's rows, in one native call
                got = cpu_kernels.ops.panel_rows(self.panels, rows)
                if got is not None:
                    return got.view(*rows.shape, self.in_features)
            w = self._dequantize_panels(self.panels, rows).to(dtype)
            return w if rows is None else w.view(*rows.shape, self.in_features)
        assert self.packed is not None
        packed = self.packed if rows is None else self.packed[rows]
        if native:
            return cpu_kernels.ops.dequantize(packed, self.fmt, self.in_features, self.group_size, dtype)
        if self.scheme == "int4":
            return packing.dequantize_int4(packed, self.in_features, self.group_size, dtype)
        return packing.dequantize_int8(packed, self.in_features, self.group_size, dtype)

    def _dequantize_panels(self, panels: cpu_kernels.ops.Int8Panels | cpu_kernels.ops.Int4Panels,
                           rows: torch.Tensor | None) -> torch.Tensor:
        """fp32 [rows, K]: q * d (+ m), as packing's dequantize computes them."""
        if isinstance(panels, cpu_kernels.ops.Int8Panels):
            q, d, m = panels.codes(rows).float(), panels.row_scales(rows), panels.row_offsets(rows)
            w = q.view(q.shape[0], d.shape[1], -1) * d[..., None]
            return (w if m is None else w + m[..., None]).view(q.shape[0], self.in_features)
        q, d, m = panels.unpack(rows)
        groups = q.float().view(q.shape[0], -1, self.group_size) * d.float()[..., None] + m.float()[..., None]
        return groups.view(q.shape[0], self.in_features)

    def weight_bytes(self) -> int:
        if self.panels is not None:
            scales = self.panels.scales
            return self.panels.data.numel() + scales.numel() * scales.element_size()
        assert self.packed is not None
        return self.packed.numel() + (0 if self.offsets is None else 4 * self.offsets.numel())


# NOTE: e4m3's largest finite value; activations are scaled per token onto it.
FP8_MAX = 448.0


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why fp8 weights cannot run on `device` (None when they can)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return None
    where = (f"this GPU (compute capability {torch.cuda.get_device_capability(device)})"
             if device.type == "cuda" else "this CPU (no FP8 instructions)")
    return (f"quantization='fp8' needs FP8 matrix hardware (CUDA compute capability 8.9+: Ada, "
            f"Hopper or later), and {where} has none. Use quantization='int8' (one byte a weight "
            "like fp8, per-channel scales), 'int4' (group-wise scales, about a third of bf16), or "
            "'gguf' for a quantized GGUF file.")


class Fp8LinearMethod:
    """e4m3 weights with one fp32 scale per output channel; `torch._scaled_mm` (CUDA 8.9+)
    multiplies them with activations quantized per token at run time (vLLM's dynamic fp8)."""

    scheme = "fp8"
    name = "fp8 (e4m3, channel)"

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        self.weight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.scale = scale.view(1, -1).contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)
        return y if bias is None else y + bias

    def dequantize(self, dtype: torch.dtype, native: bool = False, rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The dense weight (or its `rows`) in `dtype`."""
        w, s = (self.weight, self.scale[0]) if rows is None else (self.weight[rows], self.scale[0][rows])
        return (w.float() * s[:, None]).to(dtype)

    def weight_bytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()


class InputPermutedMethod:
    """A packed method whose weight's input columns were reordered (GPTQ's act order: each
    group's columns together, gptq_awq.py): x's columns are gathered the same way before the
    product; the native decoder stack gathers them too (`perm` beside the inner method's
    native weight), and the inner records go onto the GEMM's panels as any layer's."""

    def __init__(self, inner: PackedLinearMethod, perm: torch.Tensor) -> None:
        self.inner, self.perm = inner, perm

    def use_gemm(self) -> bool:
        return self.inner.use_gemm()

    @property
    def panels(self) -> cpu_kernels.ops.Int8Panels | cpu_kernels.ops.Int4Panels | None:
        return self.inner.panels

    def native_weight(self) -> cpu_kernels.ops.Int8Panels | cpu_kernels.ops.Int4Panels | cpu_kernels.ops.Records | None:
        return self.inner.native_weight()

    @property
    def name(self) -> str:
        return f"{self.inner.name}, act order"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner.apply(layer, x.index_select(-1, self.perm), bias)

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes() + self.perm.numel() * self.perm.element_size()

    def dequantize(self, dtype: torch.dtype, native: bool = False, rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The dense weight in the checkpoint's column order."""
        w = self.inner.dequantize(dtype, native, rows)
        out = torch.empty_like(w)
        out[..., self.perm] = w
        return out
