"""GGUF-packed weights: a quantized GGUF's blocks kept as they are, mapped onto the kernels.

Q4_0 and Q4_1 become int4 with groups of 32 (Q4_1's `q * d + m` is int4 with scale d and
offset m; Q4_0's `(q - 8) * d` has offset -8d), Q8_0 becomes int8 with groups of 32; the
scales are the file's own f16 values, so the weights are exactly the file's.
The tensors travel through the normal weight loaders (fused shards, tensor-parallel
narrowing): before loading, each `Linear` whose checkpoint tensors are all of one of these
kinds is prepared (`prepare_gguf_load`): its weight receives the integer codes (exact in any
float dtype) and two new parameters, `weight_scale` and `weight_zero` [out, in / 32], receive
d and m through the weight's own loader; after loading, `finish_gguf_load` packs them and
`quantization.finish_gguf` frees the codes. Other
tensors (norms, K-quants, F16) load dequantized, as without quantization.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagoda.layers.linear import UNQUANTIZED, Linear
from pagoda.layers.quantization import packing
from pagoda.layers.quantization.methods import PackedLinearMethod

GGUF_GROUP_SIZE = 32
SCHEMES = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


def _sources(module_name: str, packed_modules: dict[str, tuple[str, int]], tied: bool,
             types: dict[str, str]) -> list[str]:
    """The checkpoint tensors (HF names without 'model.') that load into one Linear."""
    if module_name == "lm_head":
        return ["lm_head.weight"] if "lm_head.weight" in types or not tied else ["embed_tokens.weight"]
    parent, _, leaf = module_name.rpartition(".")
    parts = [part for part, (fused, _) in packed_modules.items() if fused == leaf]
    return [f"{parent}.{part}.weight" for part in parts] if parts else [f"{module_name}.weight"]


def _scheme_for(layer: Linear, kinds: set[str | None]) -> str | None:
    schemes = {SCHEMES.get(k or "") for k in kinds}
    if len(schemes) != 1 or None in schemes:
        return None
    scheme = schemes.pop()
    if scheme == "int4" and packing.check_int4_shape(layer.in_features, GGUF_GROUP_SIZE):
        return None
    return scheme if layer.in_features % GGUF_GROUP_SIZE == 0 else None


def prepare_gguf_load(model: nn.Module, types: dict[str, str]) -> set[str]:
    """Prepares every Linear whose tensors are Q4_0/Q4_1/Q8_0; returns those tensors' names.

    Args:
        types: GGUF tensor kind ('Q4_1', 'F32', ...) by HF name without the 'model.' prefix.
    """
    tied = getattr(getattr(model, "dims", None), "tie_word_embeddings", False)
    packed_modules = getattr(model, "packed_modules", {})
    names: set[str] = set()
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.method is not UNQUANTIZED:
            continue
        sources = _sources(module_name, packed_modules, tied, types)
        scheme = _scheme_for(layer, {types.get(s) for s in sources})
        if scheme is None:
            continue
        prepare_linear(layer, scheme)
        names.update(sources)
    return names


def prepare_linear(layer: Linear, scheme: str) -> None:
    """Readies one Linear to receive `scheme` ('int4' or 'int8') codes and block scales."""
    _add_group_param(layer, "weight_scale")
    if scheme == "int4":
        _add_group_param(layer, "weight_zero")
    setattr(layer, "gguf_scheme", scheme)  # noqa: B010 - a plain attribute on an nn.Module


def _add_group_param(layer: Linear, name: str) -> None:
    groups = layer.in_features // GGUF_GROUP_SIZE
    param = nn.Parameter(torch.empty(layer.out_features, groups, dtype=torch.float32,
                                     device=layer.weight.device), requires_grad=False)
    param.weight_loader = functools.partial(_group_loader, layer)  # type: ignore[attr-defined]
    setattr(layer, name, param)


def _group_loader(layer: Linear, param: nn.Parameter, loaded: torch.Tensor, *shard: int) -> None:
    """Loads per-group values through the weight's own loader (which knows the fused shards
    and the tensor-parallel narrowing): expanded to the weight's shape, into a NaN-filled
    scratch whose written rows are then taken back one value per group."""
    scratch = nn.Parameter(torch.full(tuple(layer.weight.shape), float("nan"), dtype=torch.float32,
                                      device=param.device), requires_grad=False)
    layer.weight.weight_loader(scratch, loaded.float().repeat_interleave(GGUF_GROUP_SIZE, dim=1),  # type: ignore[attr-defined]
                               *shard)
    rows = ~torch.isnan(scratch.data[:, 0])
    param.data[rows] = scratch.data[rows, ::GGUF_GROUP_SIZE]


def finish_gguf_load(model: nn.Module) -> None:
    """Packs every prepared Linear's codes and scales and drops the scale parameters (the
    float weight, holding codes, goes in `quantization.finish_gguf`)."""
    for layer in model.modules():
        scheme = getattr(layer, "gguf_scheme", None)
        if not isinstance(layer, Linear) or scheme is None:
            continue
        q, d = layer.weight.data, getattr(layer, "weight_scale").data  # noqa: B009
        if scheme == "int4":
            packed = packing.pack_int4(q.round().clamp(0, 15), d, getattr(layer, "weight_zero").data)  # noqa: B009
        else:
            packed = packing.pack_int8(q.round().clamp(-128, 127), d)
        for name in ("weight_scale", "weight_zero", "gguf_scheme"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.method = PackedLinearMethod(scheme, packed, layer.in_features, GGUF_GROUP_SIZE)
