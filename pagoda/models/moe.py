"""Mixture-of-experts members of the Llama family: Mixtral and Qwen3-MoE.

Each is llama.py's model (attention, norms, rotary, pipeline stages as there; Qwen3-MoE with
per-head q/k norm, Mixtral with Mistral's sliding window) whose feed-forward block is, in its
sparse layers, a `SparseMoeBlock`: a router and the experts (layers/fused_moe.py). Which
layers are sparse follows Hugging Face: every layer for Mixtral; for Qwen3-MoE the layers
whose index + 1 is a multiple of `decoder_sparse_step`, less `mlp_only_layers` (dense, with
`intermediate_size`). Routing: softmax over the router's logits, top `num_experts_per_tok`,
renormalized (Mixtral always; Qwen3-MoE when `norm_topk_prob`). Checkpoint names: Mixtral's
`block_sparse_moe.gate` and `experts.{e}.w1/w3/w2`, Qwen3-MoE's `mlp.gate` and
`mlp.experts.{e}.gate_proj/up_proj/down_proj`, both loaded into `mlp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.distributed.group import ParallelGroup
from pagoda.layers.fused_moe import FusedMoE, Router, expert_target
from pagoda.models.llama import LlamaDims, LlamaFlags, LlamaForCausalLM


@dataclass(frozen=True)
class MoeDims:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    weights_in_model_dtype: bool
    sparse_step: int
    mlp_only_layers: frozenset[int]

    @classmethod
    def from_hf(cls, config: object) -> MoeDims:
        """Reads a MixtralConfig (whose `num_experts` is `num_local_experts`) or Qwen3MoeConfig."""
        c: Any = config
        return cls(
            num_experts=int(c.num_experts), top_k=int(c.num_experts_per_tok),
            intermediate_size=int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size),
            # NOTE: Mixtral has no `norm_topk_prob` and always renormalizes; it scales expert
            # outputs by fp32 weights, Qwen3-MoE by weights rounded to the model's dtype.
            renormalize=bool(getattr(c, "norm_topk_prob", True)),
            weights_in_model_dtype=getattr(c, "model_type", None) != "mixtral",
            sparse_step=int(getattr(c, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=frozenset(getattr(c, "mlp_only_layers", None) or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.sparse_step == 0)


class SparseMoeBlock(nn.Module):
    """A sparse layer's feed-forward block: the router's logits, then the experts."""

    def __init__(self, hidden_size: int, moe: MoeDims, tp: ParallelGroup) -> None:
        super().__init__()
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden_size, moe.intermediate_size,
                                moe.renormalize, moe.weights_in_model_dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.experts.native
        if native is not None and native.takes(x):
            return native(x)
        return self.experts(x, self.gate(x))


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen3-MoE (the registry's flags tell them apart): `LlamaForCausalLM` with a
    `SparseMoeBlock` as the sparse layers' MLP."""

    def make_mlp(self, config: object, d: LlamaDims, flags: LlamaFlags, tp: ParallelGroup,
                 layer: int) -> nn.Module | None:
        moe = MoeDims.from_hf(config)
        return SparseMoeBlock(d.hidden_size, moe, tp) if moe.is_sparse(layer) else None

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """The parameter (and shard) of a checkpoint tensor named differently here: an expert's
        projection (its expert's slice of the stacked weights), or Mixtral's router; None for
        the names the packed-module table maps."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_target(name) or ((name, None) if name.endswith(".mlp.gate.weight") else None)
