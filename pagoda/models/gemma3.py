"""Gemma 3 (text): local (sliding window) and global attention layers interleaved.

What sets it apart from the Llama family (llama.py), each as Hugging Face's Gemma3ForCausalLM
computes it: every layer's kind (`layer_types`: "sliding_attention" or "full_attention") gives
its attention its own window and rotary table (local layers `rope_local_base_freq`, global ones
`rope_theta` with any `rope_scaling`, both read from `rope_parameters` per kind); per-head q/k
RMSNorm; norms after attention and around the MLP as well as before them; RMSNorm as
x * (1 + w) in float32 (`GemmaRMSNorm`); GeGLU with tanh GELU; embeddings scaled by
sqrt(hidden_size) in the embedding's dtype; `query_pre_attn_scalar ** -0.5` as the attention
scale; final logits soft-capped when the config asks; tied embeddings.
As in llama.py, tensor parallelism lives in the layers, the residual stream travels beside the
hidden state, and a `PipelineStage` builds only its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed.group import SINGLE, WHOLE, ParallelGroup, PipelineStage
from pagoda.layers.activation import GeluAndMul
from pagoda.layers.attention import PagedAttention
from pagoda.layers.attention_backend import AttentionMetadata
from pagoda.layers.norm import GemmaRMSNorm
from pagoda.layers.rotary import RotaryEmbedding, RotaryInputs, inv_freq_for
from pagoda.layers.tensor_parallel import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagoda.models.llama import DecoderOnlyLM, FusedLayers, Intermediate, LlamaFlags

LAYER_TYPES = ("sliding_attention", "full_attention")
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class Gemma3Dims:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_bias: bool
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    gelu_approximate: str

    @classmethod
    def from_hf(cls, config: object) -> Gemma3Dims:
        """Reads a Gemma3TextConfig.

        Raises:
            ValueError: for what pagoda does not compute (attention soft-capping, bidirectional
                attention, another activation, an unknown layer type).
        """
        c = config
        _refuse_unsupported(c)
        layer_types = tuple(_layer_types(c))
        heads = c.num_attention_heads  # type: ignore[attr-defined]
        return cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,  # type: ignore[attr-defined]
            num_layers=c.num_hidden_layers, num_heads=heads,  # type: ignore[attr-defined]
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,  # type: ignore[attr-defined]
            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,  # type: ignore[attr-defined]
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
            layer_types=layer_types,
            sliding_window=getattr(c, "sliding_window", None) if "sliding_attention" in layer_types else None,
            attention_bias=bool(getattr(c, "attention_bias", False)),
            query_pre_attn_scalar=float(c.query_pre_attn_scalar),  # type: ignore[attr-defined]
            final_logit_softcapping=getattr(c, "final_logit_softcapping", None),
            gelu_approximate=GELU_APPROXIMATIONS[_activation(c)],
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None for a global layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def _activation(config: object) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in GELU_APPROXIMATIONS:
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported; "
                         f"pagoda computes {sorted(GELU_APPROXIMATIONS)}")
    return str(act)


def _layer_types(config: object) -> list[str]:
    """`layer_types`, or the older `sliding_window_pattern` (every n-th layer global)."""
    n = config.num_hidden_layers  # type: ignore[attr-defined]
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = int(getattr(config, "sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n:
        raise ValueError(f"Gemma 3 layer_types must be {n} of {LAYER_TYPES}, got {list(types)}")
    return list(types)


def _refuse_unsupported(config: object) -> None:
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"Gemma 3 attn_logit_softcapping={softcap} is not supported (Gemma 3 sets None)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 use_bidirectional_attention=True is not supported (causal LM only)")


class Gemma3Attention(nn.Module):
    def __init__(self, d: Gemma3Dims, window: int | None, tp: ParallelGroup) -> None:
        super().__init__()
        self.num_heads = tp.shard(d.num_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(d.num_kv_heads, "num_key_value_heads")[1]
        self.q_size = self.num_heads * d.head_dim
        self.kv_size = self.num_kv_heads * d.head_dim
        self.head_dim = d.head_dim
        q_total, kv_total = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.qkv_proj = MergedColumnParallelLinear(d.hidden_size, [q_total, kv_total, kv_total],
                                                   d.attention_bias, tp)
        self.o_proj = RowParallelLinear(q_total, d.hidden_size, d.attention_bias, tp)
        self.q_norm = GemmaRMSNorm(d.head_dim, d.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d.head_dim, d.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d.head_dim,
                                   scale=d.query_pre_attn_scalar**-0.5, sliding_window=window)

    def forward(self, x: torch.Tensor, rope: RotaryInputs, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, d: Gemma3Dims, tp: ParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(d.hidden_size, [d.intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(d.intermediate_size, d.hidden_size, False, tp)
        self.act = GeluAndMul(d.gelu_approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, d: Gemma3Dims, layer: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.layer_type = d.layer_types[layer]
        self.input_layernorm = GemmaRMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = Gemma3Attention(d, d.window(layer), tp)
        self.post_attention_layernorm = GemmaRMSNorm(d.hidden_size, d.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = Gemma3MLP(d, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(d.hidden_size, d.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: RotaryInputs,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, the residual stream before it is added)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.forward_with_residual(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, meta))
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(DecoderOnlyLM):
    """Token ids and positions of a flattened batch in, hidden states out; logits on demand."""

    def __init__(self, config: object, flags: LlamaFlags, max_positions: int,
                 tp: ParallelGroup = SINGLE, stage: PipelineStage = WHOLE) -> None:
        """`flags` are the registry's (unused: Gemma 3 reads everything from its config)."""
        super().__init__()
        d = Gemma3Dims.from_hf(config)
        self.dims = d
        self.build_stage(d.vocab_size, d.hidden_size, d.tie_word_embeddings, d.num_layers,
                         lambda i: Gemma3DecoderLayer(d, i, tp), lambda: GemmaRMSNorm(d.hidden_size, d.rms_norm_eps),
                         tp, stage)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(*inv_freq_for(config, d.head_dim, kind), max_positions)
            for kind in sorted(set(d.layer_types))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Intermediate | None = None,
                fused: FusedLayers | None = None) -> torch.Tensor | Intermediate:
        """The final hidden states, or this stage's `Intermediate` (see LlamaForCausalLM);
        `fused` (the runner's native decoder stack), when it takes the step, runs every layer."""
        if intermediate is None:
            assert self.embed_tokens is not None
            h = self.embed_tokens(input_ids)
            h, residual = h * torch.tensor(self.dims.hidden_size**0.5, dtype=h.dtype), None
        else:
            h, residual = intermediate
        if fused is not None and fused.takes(h, positions, meta):
            h, residual = fused(h, residual, positions, meta)
            return self.finish(h, residual)
        ropes = {kind: rotary(positions, h.dtype) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            if isinstance(layer, Gemma3DecoderLayer):
                h, residual = layer(h, residual, ropes[layer.layer_type], meta)
        return self.finish(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        logits = self.lm_head(hidden)
        cap = self.dims.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers if isinstance(layer, Gemma3DecoderLayer)]

