"""GGUF-packed weights: a quantized GGUF's blocks kept as integer codes, mapped onto the kernels.

Each GGUF kind (decoded by models/gguf_blocks.py into codes, group scales and offsets) maps
onto a record format the kernels take (packing.py); `RecordFormat.offsets` marks int8
records whose per-group offsets m are added outside the kernel (`PackedLinearMethod`):

| kind | records | exactness against `gguf`'s dequantization |
|---|---|---|
| Q4_0, Q4_1 | int4, groups of 32 (Q4_0: q + 8, offset -8d) | exact |
| Q8_0, Q5_0 | int8, groups of 32 (Q5_0: q - 16), the file's f16 scales kept f16 | exact |
| Q5_1, Q5_K | int8, groups of 32, codes q, offsets outside | exact (fp32 scales and offsets) |
| Q6_K | int8, groups of 16, codes q - 32 | exact (fp32 scales d * sc) |
| Q4_K | int4, groups of 32, scale d * sc and offset -dmin * m | near: both rounded to f16 |

On the avx512bf16 and avx2 kernels the int4 records and Q8_0/Q5_0's int8 records (f16 scales,
no offsets) are repacked into the GEMM's panels at load (`PackedLinearMethod.use_gemm`), and so
are the other int8 records (fp32 scales by groups of 16 or 32, their offsets inside the panels:
Q6_K, Q5_K, Q5_1 and mixed layers), so that every layer of a Q4_K_M or Q5_K_M file runs the
native decoder stack (codes in [-32, 31], the k-quants', multiplied as unsigned bytes on the
avx2 build: `ops.Int8Panels.code_bias`; wider ones, a Q5_K_M qkv mixing Q8_0 with Q5_1, + 128).
On avx512bf16 the 5-bit layers (Q5_0; Q5_K, Q5_1 with their fp32 scales and offsets) become
int5 panels (`methods._int5_panels`). On AMX tiles (the
avx512bf16 build, from the measured row count) every panel kind is widened to bf16 with its
group scales and offsets applied (each weight rounded once to bf16) and multiplies x as it is.

NOTE: Q4_K's d * sc (f16 d times a 6-bit sc: up to 17 significant bits) and dmin * m do not
always fit the int4 records' f16 (11 bits): each is rounded to nearest, by at most 2^-11 of
itself, so a weight moves by at most 2^-11 (|q d sc| + |dmin m|) (2^-25 absolute more for
each f16 subnormal). Measured over Gemma 3 270M's 27 Q4_K tensors against `gguf`: max |error|
8.1e-4 of the tensor's max |w|, RMS error 7.2e-4 of its RMS; the bf16 copy that loading
without quantization makes has 3.6e-3 and 1.7e-3 (it rounds every weight by up to 2^-9 of
itself, where near-zero Q4_K weights, d * sc * q - dmin * m cancelling, can move by more than
themselves here). Storing Q4_K as int8 with offsets outside would be exact at twice the bytes.

A fused layer's sources (q, k, v; gate, up) must share one format; where their preferred
formats differ (Q5_0 q and k with a Q6_K v) or int4 does not fit K, the layer takes the int8
form that every kind has (its own codes, fp32 scales, and offsets outside where any source
has offsets): exact, groups of 16 if any source is Q6_K.

Loading: before the weights load, each `Linear` whose checkpoint tensors all map is prepared
(`prepare_gguf_load`): its weight receives the integer codes (exact in any float dtype), and
new parameters `weight_scale` and `weight_zero` [out, in / group] receive the scales and
offsets through the weight's own loader (fused shards, tensor-parallel narrowing); after
loading, `finish_gguf_load` packs them and `quantization.finish_gguf` frees the codes. Other
tensors (norms, F16, kinds not listed) load dequantized, as without quantization.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers.linear import Linear, is_unquantized
from pagoda.layers.quantization import packing
from pagoda.layers.quantization.methods import InputPermutedMethod, PackedLinearMethod

if TYPE_CHECKING:
    from pagoda.models.gguf_blocks import Blocks

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class RecordFormat:
    """What a layer's GGUF tensors become: `scheme` ('int4' or 'int8') records with groups of
    `group_size`, and for int8 whether per-group offsets are added outside the kernel."""

    scheme: str
    group_size: int
    offsets: bool = False

    def describe(self) -> str:
        return f"{self.scheme} (group {self.group_size}{', offsets' if self.offsets else ''})"


_INT4 = RecordFormat("int4", 32)
PREFERRED = {"Q4_0": _INT4, "Q4_1": _INT4, "Q4_K": _INT4, "Q8_0": RecordFormat("int8", 32),
             "Q5_0": RecordFormat("int8", 32), "Q5_1": RecordFormat("int8", 32, True),
             "Q5_K": RecordFormat("int8", 32, True), "Q6_K": RecordFormat("int8", 16)}
_WITH_OFFSETS = {"Q4_1", "Q4_K", "Q5_1", "Q5_K"}
_GROUP = {kind: 16 if kind == "Q6_K" else 32 for kind in PREFERRED}


def int8_form(kinds: set[str]) -> RecordFormat:
    """The int8 records that hold every one of `kinds` exactly (each kind's own codes)."""
    return RecordFormat("int8", min(_GROUP[k] for k in kinds), bool(kinds & _WITH_OFFSETS))


def linear_sources(module_name: str, packed_modules: dict[str, tuple[str, int]], tied: bool,
             types: dict[str, str]) -> list[str]:
    """The checkpoint tensors (HF names without 'model.') that load into one Linear."""
    if module_name == "lm_head":
        return ["lm_head.weight"] if "lm_head.weight" in types or not tied else ["embed_tokens.weight"]
    parent, _, leaf = module_name.rpartition(".")
    parts = [part for part, (fused, _) in packed_modules.items() if fused == leaf]
    return [f"{parent}.{part}.weight" for part in parts] if parts else [f"{module_name}.weight"]


def format_for(layer: Linear, kinds: set[str | None]) -> RecordFormat | None:
    """The records for a layer whose sources are of `kinds` (None: it stays unpacked)."""
    known = {k for k in kinds if k in PREFERRED}
    if not known or len(known) != len(kinds):
        return None
    preferred = {PREFERRED[k] for k in known}
    fmt = preferred.pop() if len(preferred) == 1 else int8_form(known)
    if fmt.scheme == "int4" and packing.check_int4_shape(layer.in_features, fmt.group_size):
        fmt = int8_form(known)
    return fmt if layer.in_features % fmt.group_size == 0 else None


def prepare_gguf_load(model: nn.Module, types: dict[str, str]) -> dict[str, RecordFormat]:
    """Prepares every Linear whose tensors all map onto records; returns those tensors' formats.

    Args:
        types: GGUF tensor kind ('Q4_K', 'F32', ...) by HF name without the 'model.' prefix.
    """
    tied = getattr(getattr(model, "dims", None), "tie_word_embeddings", False)
    packed_modules = getattr(model, "packed_modules", {})
    formats: dict[str, RecordFormat] = {}
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear) or not is_unquantized(layer):
            continue
        sources = linear_sources(module_name, packed_modules, tied, types)
        fmt = format_for(layer, {types.get(s) for s in sources})
        if fmt is None:
            continue
        prepare_linear(layer, fmt)
        formats.update(dict.fromkeys(sources, fmt))
    return formats


def to_format(blocks: Blocks, fmt: RecordFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A tensor's decoded blocks as `fmt` holds them: (codes int8, scales fp32, offsets fp32 or
    None) with one scale (and offset) per group of `fmt.group_size`; w = codes * scale + offset.
    int4 codes are moved into [0, 15] (Q4_0's q - 8 back to q, its offset -8d)."""
    codes, scale, offset = blocks.codes, blocks.scale, blocks.offset
    if fmt.scheme == "int4":
        shift = -blocks.code_range[0]
        if shift:
            codes, offset = codes + shift, (0 if offset is None else offset) - shift * scale
        return codes, scale, torch.zeros_like(scale) if offset is None else offset
    repeat = blocks.group_size // fmt.group_size
    scale = scale.repeat_interleave(repeat, dim=1)
    if not fmt.offsets:
        return codes, scale, None
    return codes, scale, torch.zeros_like(scale) if offset is None else offset.repeat_interleave(repeat, dim=1)


def prepare_linear(layer: Linear, fmt: RecordFormat) -> None:
    """Readies one Linear to receive `fmt`'s codes, group scales and (int4, offsets) offsets."""
    _add_group_param(layer, "weight_scale", fmt.group_size)
    if fmt.scheme == "int4" or fmt.offsets:
        _add_group_param(layer, "weight_zero", fmt.group_size)
    setattr(layer, "gguf_format", fmt)  # noqa: B010 - a plain attribute on an nn.Module


def _add_group_param(layer: Linear, name: str, group_size: int) -> None:
    groups = layer.in_features // group_size
    param = nn.Parameter(torch.empty(layer.out_features, groups, dtype=torch.float32,
                                     device=layer.weight.device), requires_grad=False)
    param.weight_loader = functools.partial(_group_loader, layer, group_size)  # type: ignore[attr-defined]
    setattr(layer, name, param)


def _group_loader(layer: Linear, group_size: int, param: nn.Parameter, loaded: torch.Tensor, *shard: int) -> None:
    """Loads per-group values through the weight's own loader (which knows the fused shards
    and the tensor-parallel narrowing) into a NaN-filled scratch whose written rows are then
    kept. Only a row-parallel shard's loader narrows columns: for it the values go expanded
    to the weight's columns and come back one a group.

    NOTE: other loaders take the [rows, groups] values as they are: expanding the LM head's
    (Gemma 3: 262144 x 640) for every loader cost 1.3 GB of fp32 scratch at the load's peak."""
    from pagoda.layers.tensor_parallel import RowParallelLinear

    columns = isinstance(layer, RowParallelLinear) and layer.tp.size > 1
    values = loaded.float().repeat_interleave(group_size, dim=1) if columns else loaded.float()
    width = layer.weight.shape[1] if columns else param.shape[1]
    scratch = nn.Parameter(torch.full((param.shape[0], width), float("nan"), dtype=torch.float32,
                                      device=param.device), requires_grad=False)
    layer.weight.weight_loader(scratch, values, *shard)  # type: ignore[attr-defined]
    rows = ~torch.isnan(scratch.data[:, 0])
    param.data[rows] = scratch.data[rows, ::group_size] if columns else scratch.data[rows]


def finish_gguf_load(model: nn.Module, source: str = "GGUF") -> None:
    """Packs every prepared Linear's codes, scales and offsets and drops those parameters (the
    float weight, holding codes, goes in `quantization.finish_gguf`); logs the formats used
    (`source`: what the codes came from, GGUF or a GPTQ/AWQ checkpoint)."""
    used: Counter[str] = Counter()
    for layer in model.modules():
        fmt = getattr(layer, "gguf_format", None)
        if not isinstance(layer, Linear) or fmt is None:
            continue
        d = getattr(layer, "weight_scale").data  # noqa: B009
        m = getattr(layer, "weight_zero").data if hasattr(layer, "weight_zero") else None  # noqa: B009
        for name in ("weight_scale", "weight_zero", "gguf_format"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.method = packed_method(fmt, layer.weight.data, d, m)
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            del layer.input_perm
            if not torch.equal(perm.data, torch.arange(perm.numel(), device=perm.device)):
                layer.method = InputPermutedMethod(layer.method, perm.data)
        used[fmt.describe() + (", act order" if isinstance(layer.method, InputPermutedMethod) else "")] += 1
    if used:
        logger.info("%s-packed layers by record format: %s", source,
                    ", ".join(f"{n} {f}" for f, n in used.items()))


def packed_method(fmt: RecordFormat, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
                  ) -> PackedLinearMethod:
    """The packed method for one layer's codes [out, in] (integers in any dtype) and its
    `fmt` group scales and offsets (`to_format`'s).

    NOTE: the codes arrive exact (int8 values copied into a float weight) and in range, so
    they become int8 as they are: one byte a weight of scratch, where rounding and clamping
    a float copy first took four (484 MiB more at the peak of Gemma 3's load, its LM head).
    """
    q = codes.to(torch.int8)
    if fmt.scheme == "int4":
        assert offset is not None
        return PackedLinearMethod("int4", packing.pack_int4(q, scale, offset), q.shape[1], fmt.group_size)
    packed = packing.pack_int8(q, scale)
    return PackedLinearMethod("int8", packed, q.shape[1], fmt.group_size,
                              None if offset is None else offset.float().contiguous())
