"""GPTQ and AWQ checkpoints (4-bit) loaded onto the int4 records, no float copy.

Both formats hold, per quantized linear (HF weight W [N out, K in], G = K / group_size groups),
w[n, k] = (q[n, k] - z[g, n]) * s[g, n] with q, z in [0, 15] and g = k // group_size:
- GPTQ: `qweight` int32 [K/8, N], eight codes packed along K (code k at bits 4 (k % 8) of row
  k // 8); `qzeros` int32 [G, N/8], packed along N; `scales` f16 [G, N]; `g_idx` [K]. The
  usual checkpoint_format "gptq" (v1) stores z - 1 (z = stored + 1, 16 for a stored 15, as
  vLLM's kernels read it); "gptq_v2" stores z.
- AWQ ("gemm" version): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], both packed
  along N in AutoAWQ's interleaved order (nibble i of a word holds column [0, 2, 4, 6, 1, 3, 5,
  7][i]: column j at nibble `AWQ_REVERSE_ORDER[j]`); `scales` f16 [G, N].
Each becomes int4 records (packing.py) with d = s (f16, exact) and m = -z * s rounded to f16:
exact where z * s fits f16's 11 significant bits (always for symmetric GPTQ, z = 8), else
within half an f16 ulp of z * s (2^-11 of it). The codes, scales and offsets load through
the GGUF path's weight loaders (gguf.py: `prepare_linear`, `finish_gguf_load`), so fused
layers and tensor-parallel shards work as there; the codes load into a byte buffer, so the
load's peak is near the packed size, not the float model's.

The settings come from config.json's `quantization_config` (as vLLM detects them), or from
an older checkpoint's quantize_config.json (GPTQ) or quant_config.json (AWQ) beside it.

Refused with a clear error: bits other than 4, group sizes other than 32/64/128 (the int4
records'), AWQ other than "gemm" or without zero points, other `quant_method`s, and a
`--quantization` that contradicts the checkpoint's.

Act order (GPTQ's desc_act): `g_idx` puts each input column k in group g_idx[k], the groups
holding group_size columns each but scattered over K. The codes' columns are reordered so that
each group's lie together (`input_perm`, a stable argsort of g_idx: exact, the same records),
and the layer gathers x's columns the same way before its product (`InputPermutedMethod`). The
fused parts of one layer share their input, hence their permutation (GPTQ's order follows the
input's Hessian); parts with different ones are refused, and so is a row-parallel shard
under tensor parallelism (its K split across ranks). The native decoder stack gathers x's
columns the same way before such a layer's product (decoder.cpp's `LinearWeight.perm`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.layers.linear import Linear, is_unquantized
from pagoda.layers.quantization import packing
from pagoda.layers.quantization.gguf import RecordFormat, linear_sources, prepare_linear

CHECKPOINT_METHODS = ("gptq", "awq")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PARTS = ("qweight", "qzeros", "scales")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class CheckpointQuant:
    """A GPTQ or AWQ checkpoint's `quantization_config`, as far as loading needs it.

    Attributes:
        method: 'gptq' or 'awq'.
        group_size: inputs per scale and zero point (32, 64 or 128).
        zero_offset: added to the stored zero points (1 for GPTQ's v1 format).
    """

    method: str
    group_size: int
    zero_offset: int = 0

    @property
    def fmt(self) -> RecordFormat:
        return RecordFormat("int4", self.group_size)


def checkpoint_quantization(hf_config: object) -> CheckpointQuant | None:
    """The checkpoint's GPTQ/AWQ quantization (None when it has no `quantization_config`).

    Raises:
        ValueError: another quant_method, or GPTQ/AWQ settings the int4 records cannot hold.
    """
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = str(config.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"The checkpoint's quantization_config has quant_method {method!r}; pagoda "
                         f"loads {list(CHECKPOINT_METHODS)} checkpoints (4-bit).")
    where = f"{method} checkpoint"
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: only 4-bit weights are supported, got bits={bits!r}.")
    group_size = config.get("group_size", config.get("q_group_size"))
    if group_size not in packing.INT4_GROUP_SIZES:
        raise ValueError(f"{where}: group_size must be one of {packing.INT4_GROUP_SIZES} (the int4 "
                         f"records' groups), got {group_size!r}.")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: only AWQ's 'gemm' layout is supported, got version={version!r}.")
        if not config.get("zero_point", True):
            raise ValueError(f"{where}: AWQ without zero points (zero_point=false) is not supported.")
        return CheckpointQuant("awq", group_size)
    v2 = str(config.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    return CheckpointQuant("gptq", group_size, 0 if v2 else 1)


# NOTE: older AutoGPTQ and AutoAWQ checkpoints keep their settings beside config.json.
LEGACY_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def attach_legacy_config(hf_config: object, folder: str) -> None:
    """Gives `hf_config` the `quantization_config` of an older checkpoint's
    quantize_config.json (GPTQ) or quant_config.json (AWQ), when it has none of its own."""
    if getattr(hf_config, "quantization_config", None) is not None:
        return
    for name, method in LEGACY_CONFIG_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
            hf_config.quantization_config = {"quant_method": method, **values}  # type: ignore[attr-defined]
            return


def resolve_quantization(requested: str | None, hf_config: object) -> str | None:
    """The quantization to load with: the checkpoint's GPTQ/AWQ, which `requested` (vLLM's
    --quantization) may name but not contradict.

    Raises:
        ValueError: a mismatch, 'gptq'/'awq' for a checkpoint without it, or a bad config.
    """
    found = checkpoint_quantization(hf_config)
    if found is None:
        if requested in CHECKPOINT_METHODS:
            raise ValueError(f"quantization={requested!r} needs a {requested.upper()} checkpoint (a "
                             "config.json with its quantization_config); this model has none.")
        return requested
    if requested not in (None, found.method):
        raise ValueError(f"The checkpoint is {found.method.upper()}-quantized (its config.json's "
                         f"quantization_config), but quantization={requested!r} was asked for; "
                         f"omit it or pass {found.method!r}.")
    return found.method


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ tensors -> (codes uint8 [N, K], z int [G, N], s f16 [G, N])."""
    codes = (qweight[:, None, :] >> _SHIFTS[None, :, None]) & 15  # [K/8, 8, N]
    zeros = ((qzeros[:, :, None] >> _SHIFTS) & 15).flatten(1)  # [G, N]
    return codes.flatten(0, 1).t().to(torch.uint8), zeros + zero_offset, scales


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ ('gemm') tensors -> (codes uint8 [N, K], z int [G, N], s f16 [G, N])."""
    order = torch.tensor(AWQ_REVERSE_ORDER)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        return ((packed[:, :, None] >> _SHIFTS) & 15)[:, :, order].flatten(1)

    return columns(qweight).t().to(torch.uint8), columns(qzeros), scales


def to_records(quant: CheckpointQuant, parts: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's checkpoint tensors -> (codes [N, K], d fp32 [N, G], m fp32 [N, G]) with
    w = codes * d + m: d = s, m = -z * s (exact in fp32; rounded to f16 when packed)."""
    qweight, qzeros, scales = (parts[p].to(torch.int32) if p != "scales" else parts[p] for p in PARTS)
    if quant.method == "gptq":
        codes, z, s = unpack_gptq(qweight, qzeros, scales, quant.zero_offset)
    else:
        codes, z, s = unpack_awq(qweight, qzeros, scales)
    d = s.to(torch.float16).float().t()
    return codes, d, -z.t().float() * d


def checkpoint_tensor_names(path: str) -> list[str]:
    """Every tensor name in the folder's safetensors files (headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


def prepare_checkpoint_load(model: nn.Module, quant: CheckpointQuant, names: Iterable[str]) -> int:
    """Readies every Linear whose checkpoint tensors are quantized to receive int4 codes,
    scales and offsets; returns how many.

    Raises:
        ValueError: a fused layer with quantized and float parts, or a layer whose input size
            the int4 records cannot hold.
    """
    names = list(names)
    quantized = {name.removeprefix("model.").removesuffix(".qweight") + ".weight": quant.method
                 for name in names if name.endswith(".qweight")}
    ordered = {name.removeprefix("model.").removesuffix(".g_idx") + ".weight"
               for name in names if name.endswith(".g_idx")}
    tied = getattr(getattr(model, "dims", None), "tie_word_embeddings", False)
    packed_modules = getattr(model, "packed_modules", {})
    count = 0
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear) or not is_unquantized(layer):
            continue
        sources = linear_sources(module_name, packed_modules, tied, quantized)
        found = [s in quantized for s in sources]
        if not any(found):
            continue
        if not all(found):
            raise ValueError(f"{quant.method} checkpoint: {module_name} fuses quantized and float "
                             f"tensors ({sources}); pagoda needs all or none quantized.")
        why = packing.check_int4_shape(layer.in_features, quant.group_size)
        if why:
            raise ValueError(f"{quant.method} checkpoint: {module_name} cannot be held as int4 records: {why}.")
        prepare_linear(layer, quant.fmt)
        if any(s in ordered for s in sources):
            _add_perm_param(layer)
        if not (tied and module_name == "lm_head"):
            # NOTE: the codes load into bytes: the float buffer the layer was built with, never
            # written, is never committed, so loading peaks near the packed size, not the float
            # model's. (A tied head's weight is the embedding's, whose dtype the model reads.)
            w = layer.weight
            w.data = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
        count += 1
    return count


def iter_checkpoint_weights(weights: Iterator[tuple[str, torch.Tensor]], quant: CheckpointQuant,
                            names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized layer's `qweight`/`qzeros`/`scales`
    (and `g_idx`, where `names` has one) turned into `weight` (codes), `weight_scale`,
    `weight_zero` (and `input_perm`), the other tensors as they are.

    Raises:
        ValueError: a `g_idx` whose groups are not group_size columns each, or a layer missing
            one of its tensors.
    """
    with_g_idx = {name.removesuffix(".g_idx") for name in names if name.endswith(".g_idx")}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in (*PARTS, "g_idx"):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(p in parts for p in PARTS) and ("g_idx" in parts or prefix not in with_g_idx):
            yield from _layer_tensors(prefix, pending.pop(prefix), quant)
    if pending:
        raise ValueError(f"{quant.method} checkpoint: layers missing some of {list(PARTS)}: "
                         f"{ {p: sorted(parts) for p, parts in pending.items()} }.")


def _layer_tensors(prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    codes, d, m = to_records(quant, parts)
    if "g_idx" in parts:
        perm = act_order(prefix, parts["g_idx"], quant)
        yield f"{prefix}.input_perm", perm
        codes = codes[:, perm]
    yield f"{prefix}.weight", codes
    yield f"{prefix}.weight_scale", d
    yield f"{prefix}.weight_zero", m


def act_order(prefix: str, g_idx: torch.Tensor, quant: CheckpointQuant) -> torch.Tensor:
    """The input columns in group order (int64 [K]: arange(K) where g_idx is k // group_size).

    Raises:
        ValueError: unless every group holds group_size columns.
    """
    g = g_idx.to(torch.int64)
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(g.numel(), dtype=torch.int64) // quant.group_size):
        raise ValueError(f"{quant.method} checkpoint: {prefix}.g_idx does not put {quant.group_size} "
                         "input columns in each group (group_size).")
    return perm


def _add_perm_param(layer: Linear) -> None:
    """The layer's `input_perm` (act order), loaded once per fused part: the parts must agree."""
    from pagoda.layers.tensor_parallel import RowParallelLinear

    param = nn.Parameter(torch.full((layer.in_features,), -1, dtype=torch.int64, device=layer.weight.device),
                         requires_grad=False)

    def load(param: nn.Parameter, loaded: torch.Tensor, *shard: int) -> None:
        if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
            if torch.equal(loaded, torch.arange(loaded.numel(), device=loaded.device)):
                param.data.copy_(torch.arange(param.numel()))  # NOTE: no act order: this shard's columns as they are
                return
            raise ValueError("An act-order (desc_act) checkpoint's row-parallel layers cannot be split "
                             "across tensor-parallel ranks here; serve it with tensor_parallel_size=1.")
        if int(param.data[0]) >= 0 and not torch.equal(param.data, loaded.to(param.device)):
            raise ValueError("An act-order (desc_act) checkpoint's fused parts (q/k/v or gate/up) have "
                             "different g_idx orders; pagoda's fused layers need one.")
        param.data.copy_(loaded)

    param.weight_loader = load  # type: ignore[attr-defined]
    layer.input_perm = param
