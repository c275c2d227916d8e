"""Rotary position embedding with a precomputed cos/sin table.

Frequencies come from transformers' own rope-initialisation functions (default, linear,
llama3, yarn, ...), so scaled variants match the reference exactly. The table is gathered by
position once per step and shared by every layer; where the CPU kernels take the positions
(`cpu_kernels.takes`) nothing is gathered and each layer rotates q and k in place with one kernel call, rounding
like `apply_rotary` in the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.layers import cpu_kernels


def rope_parameters(config: object, layer_type: str | None = None) -> dict:
    """The config's rope parameters; with `layer_type`, those of that kind of layer (Gemma 3
    nests them: {"sliding_attention": {...}, "full_attention": {...}})."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"rope parameters name no {layer_type!r} layers: {sorted(params)}")
        params = params[layer_type]
    return dict(params)


def inv_freq_for(config: object, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq, attention_scaling) for the config's rope type (of `layer_type`'s layers)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial}, e.g. Phi-4-mini's) "
                         "are not supported")
    if rope_type == "longrope":
        # NOTE: Phi-3's long-context RoPE switches factors once a sequence passes the original
        # context, per forward: one fixed table cannot hold both.
        raise ValueError("rope_type 'longrope' (Phi-3's 128k variants) is not supported; the 4k variants "
                         "(plain RoPE) are")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        extra = {} if layer_type is None else {"layer_type": layer_type}
        # NOTE: on the CPU whatever device the model is built under (RotaryEmbedding moves it).
        with torch.device("cpu"):
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
    finally:
        torch.set_default_dtype(previous)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        # NOTE: transformers' rope functions make their table on the CPU; the model may be
        # built under another device (found on CUDA: every scaled rope failed to build).
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryInputs:
        """What every layer of this step needs to rotate its q and k."""
        if cpu_kernels.takes(positions):
            return RotaryInputs(positions, self.cos, self.sin, native=True)  # type: ignore[arg-type]
        cos: torch.Tensor = self.cos  # type: ignore[assignment]
        sin: torch.Tensor = self.sin  # type: ignore[assignment]
        return RotaryInputs(positions, cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1))


@dataclass
class RotaryInputs:
    """One step's rotary inputs: fp32 tables [max_positions, head_dim] (native) or cos/sin
    gathered per token as [tokens, 1, head_dim] in the model dtype (torch path)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    native: bool = False

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [T, H, D] and k [T, KV, D]; the native path rotates them in place."""
        if self.native:
            cpu_kernels.ops.rotary_inplace(q, self.positions, self.cos, self.sin)
            cpu_kernels.ops.rotary_inplace(k, self.positions, self.cos, self.sin)
            return q, k
        joint = _adjacent_heads(q, k)
        if joint is None:
            return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        # NOTE: q and k side by side in one projection's output are rotated as one tensor:
        # the same elementwise operations, half the kernel launches (what bounds a CUDA step).
        out = apply_rotary(joint, self.cos, self.sin)
        return out[:, :q.shape[1]], out[:, q.shape[1]:]


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, KV, D] as one [T, H + KV, D] view when k's heads follow q's in
    memory with the same strides (the fused qkv projection's split), else None."""
    # NOTE: one token's views may carry any stride for their size-1 first dimension.
    if (q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype
            or q.stride()[1:] != (q.shape[2], 1) or k.stride()[1:] != (k.shape[2], 1)
            or (q.shape[0] > 1 and q.stride(0) != k.stride(0))):
        return None
    # NOTE: one storage, not just adjacent addresses: a caching allocator (CUDA's) may place two
    # separate tensors (Qwen3's normed q and k) end to end, and a view must stay in its storage.
    if (k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
