"""Weight quantization as a linear method (vLLM's `quantization` names).

- `int8`: weight-only int8, one scale per output channel; activations stay bf16/fp32.
- `int4`: weight-only int4 with a scale and an offset per group of 32, 64 or 128 inputs.
- `gguf`: a quantized GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) kept as
  integer codes and group scales in int4/int8 records (gguf.py), no float copy.
- `fp8`: e4m3 weights with per-channel scales, where the hardware multiplies fp8 (CUDA 8.9+).
- `gptq`, `awq`: a 4-bit GPTQ or AWQ checkpoint (found from its config, as vLLM) loaded onto
  the int4 records (gptq_awq.py), no float copy.

`quantize_model` applies int8/int4/fp8 from the outside after loading (gpt-fast style): each
`Linear` (tensor-parallel shards included, each rank its own shard) gets a packed method and
drops its float weight, and so does each projection of each mixture-of-experts expert
(`FusedMoE.expert_methods`; the routers stay in the model's dtype); the model files know
nothing of it. The LM head is quantized too;
with tied embeddings the embedding then reads the head's packed rows (its float table, the
head's, freed: `VocabParallelEmbedding`), so the table is stored once. With int4 the head is
int8 (per channel): the most sensitive layer gets 8 bits, as in llama.cpp's 4-bit files. Untied embeddings and norms stay in the
model's dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.distributed.group import ParallelGroup
from pagoda.layers.fused_moe import FusedMoE
from pagoda.layers.linear import Linear, is_unquantized
from pagoda.layers.quantization import packing
from pagoda.layers.quantization.methods import (
    Fp8LinearMethod,
    PackedLinearMethod,
    fp8_unsupported_reason,
)

logger = logging.getLogger("pagoda")

QUANTIZATION_METHODS = ("int8", "int4", "gguf", "fp8", "gptq", "awq")


@dataclass(frozen=True)
class QuantizationReport:
    """What quantization did to the weights (bytes of every parameter and packed tensor)."""

    scheme: str
    bytes_before: int
    bytes_after: int
    num_quantized: int
    num_kept: int

    def describe(self) -> str:
        mib = 1024**2
        which = ("the checkpoint's quantized ones" if self.scheme in ("gptq", "awq") else
                 "LM head included, int8 under int4; a tied embedding reads its packed rows")
        return (f"Quantization {self.scheme}: weights {self.bytes_before / mib:.1f} MiB -> "
                f"{self.bytes_after / mib:.1f} MiB ({self.bytes_after / max(self.bytes_before, 1):.2f}x); "
                f"{self.num_quantized} linear layers packed ({which}), {self.num_kept} left unquantized")

    def describe_panels(self, bytes_now: int, kinds: dict[str, int]) -> str:
        """The weights as the CPU kernels hold them once repacked (`bytes_now`), with the layers
        by what they hold (`kinds`: name -> layers)."""
        mib = 1024**2
        layers = ", ".join(f"{n} {name}" for name, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        return (f"Weights as the CPU kernels hold them: {bytes_now / mib:.1f} MiB "
                f"({bytes_now / max(self.bytes_before, 1):.2f}x of {self.bytes_before / mib:.1f} MiB); {layers}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: unique parameters plus the packed tensors of its methods."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    experts = sum(m.weight_bytes() for m in model.modules() if isinstance(m, FusedMoE))
    return total + experts + method_bytes(model)


def linear_methods(model: nn.Module) -> list[Any]:
    """The model's linear methods, each once (a method may serve two modules: a tied head)."""
    return list({id(m.method): m.method for m in model.modules() if hasattr(m, "method")}.values())


def method_bytes(model: nn.Module) -> int:
    """Bytes the linear methods hold (records, panels or a packed copy)."""
    return sum(m.weight_bytes() for m in linear_methods(model))


def make_method(scheme: str, weight: torch.Tensor, group_size: int,
                amax: torch.Tensor | None = None) -> PackedLinearMethod | Fp8LinearMethod:
    """The packed method for one float weight [out, in] (round to nearest).

    Args:
        amax: int8 only, max|w| per output channel over the whole row (see `_row_amax`).
    """
    n, k = weight.shape
    if scheme == "int8":
        return PackedLinearMethod("int8", packing.quantize_int8(weight, amax=amax), k, k)
    if scheme == "int4":
        return PackedLinearMethod("int4", packing.quantize_int4(weight, group_size), k, group_size)
    return Fp8LinearMethod(weight)


def _why_not(layer: Linear, scheme: str, group_size: int) -> str | None:
    if not layer.weight.numel():
        return "no weight"
    return _why_not_shape(layer.out_features, layer.in_features, scheme, group_size)


def _why_not_shape(out_features: int, in_features: int, scheme: str, group_size: int) -> str | None:
    """Why a weight [out_features, in_features] cannot be packed in `scheme` (None: it can)."""
    if scheme == "int4" and packing.int4_group_size(in_features, group_size) is None:
        return f"in_features {in_features} is not a multiple of 64"
    if scheme == "int8" and in_features % 32:
        return f"in_features {in_features} is not a multiple of 32"
    if scheme == "fp8" and (in_features % 16 or out_features % 16):
        return "fp8 products need sizes that are multiples of 16"
    return None


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32,
                   device: torch.device | None = None) -> QuantizationReport:
    """Swaps every Linear's float weight for a packed `scheme` method (int8, int4 or fp8).

    Raises:
        ValueError: fp8 on a device without fp8 matrix hardware (the message names the
            alternatives), or an unknown scheme.
    """
    if scheme not in ("int8", "int4", "fp8"):
        raise ValueError(f"quantize_model takes 'int8', 'int4' or 'fp8', got {scheme!r}.")
    if scheme == "fp8":
        reason = fp8_unsupported_reason(device or torch.device("cpu"))
        if reason:
            raise ValueError(reason)
    before = weight_bytes(model)
    done = kept = 0
    smaller: set[int] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or not is_unquantized(layer):
            continue
        why = _why_not(layer, scheme, group_size)
        if why:
            logger.info("Quantization %s: %s stays unquantized (%s)", scheme, name, why)
            kept += 1
            continue
        # NOTE: int4 keeps the LM head (and so a tied embedding) in int8, as llama.cpp keeps
        # its output tensor above 4 bits: on SmolLM2 an int4 head alone cost several percent
        # of perplexity (docs/benchmarks.md, Quantization); int8 costs ~0.3%.
        layer_scheme = "int8" if scheme == "int4" and name == "lm_head" else scheme
        layer_group = packing.int4_group_size(layer.in_features, group_size) or group_size
        if layer_scheme == "int4" and layer_group != group_size:
            smaller.add(layer_group)
        layer.method = make_method(layer_scheme, layer.weight.data, layer_group, _row_amax(layer, layer_scheme))
        done += 1
    if smaller:
        logger.info("Quantization int4: layers whose inputs are not a multiple of %d use groups of %s",
                    group_size, sorted(smaller))
    experts_done, experts_kept = _quantize_experts(model, scheme, group_size)
    done, kept = done + experts_done, kept + experts_kept
    _free_float_weights(model)
    label = scheme if scheme != "int4" else f"int4 (group {group_size})"
    return QuantizationReport(label, before, weight_bytes(model), done, kept)


def _row_amax(layer: Linear, scheme: str) -> torch.Tensor | None:
    """max|w| per output channel over the whole row for a row-parallel int8 shard (each rank
    holds some of the columns): the group's maximum, so that the per-channel scales, and so
    the codes, are those of the unsharded model. (int4 groups never straddle shards.)"""
    from pagoda.layers.tensor_parallel import RowParallelLinear

    if scheme != "int8" or not isinstance(layer, RowParallelLinear) or layer.tp.size == 1:
        return None
    return _group_amax(layer.weight.data, layer.tp)


def _group_amax(weight: torch.Tensor, tp: ParallelGroup) -> torch.Tensor:
    """max|w| along the last dimension, over the group's shards of it."""
    import torch.distributed as dist

    amax = weight.abs().amax(dim=-1).float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return amax


def _quantize_experts(model: nn.Module, scheme: str, group_size: int) -> tuple[int, int]:
    """Each `FusedMoE` expert's gate_up and down projections packed like a `Linear`'s weight
    (`expert_methods`), the stacked float weights freed; int8 down scales per output channel
    over the group's shards, as a row-parallel layer's. Returns (projections packed, layers
    whose experts stay unquantized)."""
    done = kept = 0
    for name, moe in model.named_modules():
        if not isinstance(moe, FusedMoE) or moe.expert_methods is not None:
            continue
        w13, w2 = moe.w13_weight.data, moe.w2_weight.data
        why = (_why_not_shape(w13.shape[1], w13.shape[2], scheme, group_size)
               or _why_not_shape(w2.shape[1], w2.shape[2], scheme, group_size))
        if why:
            logger.info("Quantization %s: %s's experts stay unquantized (%s)", scheme, name, why)
            kept += 1
            continue
        group13, group2 = (packing.int4_group_size(w.shape[2], group_size) or group_size for w in (w13, w2))
        amax = _group_amax(w2, moe.tp) if scheme == "int8" and moe.tp.size > 1 else None
        moe.expert_methods = [
            (make_method(scheme, w13[e], group13),
             make_method(scheme, w2[e], group2, None if amax is None else amax[e]))
            for e in range(moe.num_experts)]
        for w in (moe.w13_weight, moe.w2_weight):
            w.data = torch.empty(0, dtype=w.dtype, device=w.device)
        done += 2 * moe.num_experts
    if done:
        logger.info("Quantization %s: %d expert projections packed (the routers stay unquantized)", scheme, done)
    return done, kept


def _free_float_weights(model: nn.Module) -> None:
    for layer in model.modules():
        if isinstance(layer, Linear) and not is_unquantized(layer):
            w = layer.weight
            w.data = torch.empty(0, dtype=w.dtype, device=w.device)


def finish_gguf(model: nn.Module, scheme: str = "gguf") -> QuantizationReport:
    """After a packed load (a GGUF's blocks, or a GPTQ/AWQ checkpoint: `scheme`): float copies
    freed (a tied embedding then reads the head's records), the report (before: the model's
    weights had every tensor been dequantized to its dtype)."""
    before = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    _free_float_weights(model)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    done = sum(1 for m in layers if not is_unquantized(m))
    return QuantizationReport(scheme, before, weight_bytes(model), done, len(layers) - done)


__all__ = ["QUANTIZATION_METHODS", "QuantizationReport", "make_method", "quantize_model", "weight_bytes",
           "method_bytes", "linear_methods"]
