"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) as one model with flags.

Flags come from the architecture and its config: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), a sliding window (Mistral), tied embeddings. The model is free of parallelism,
quantization and cache-management code: it reads the `AttentionMetadata` it is given.
Layers carry the residual stream separately (vLLM's layout), so that "add the residual, then
normalize" is one step (`RMSNorm.forward_with_residual`); the sums are those of Hugging Face's
`h = h + f(norm(h))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import AttentionMetadata, PagedAttention
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, RotaryInputs, inv_freq_for


@dataclass(frozen=True)
class LlamaFlags:
    """What distinguishes one family member from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    use_sliding_window: bool = False


@dataclass(frozen=True)
class LlamaDims:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: object, flags: LlamaFlags) -> LlamaDims:
        c = config
        heads = c.num_attention_heads  # type: ignore[attr-defined]
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads  # type: ignore[attr-defined]
        window = getattr(c, "sliding_window", None) if flags.use_sliding_window else None
        return cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,  # type: ignore[attr-defined]
            num_layers=c.num_hidden_layers, num_heads=heads,  # type: ignore[attr-defined]
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,  # type: ignore[attr-defined]
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            sliding_window=window,
        )


class LlamaAttention(nn.Module):
    def __init__(self, d: LlamaDims, flags: LlamaFlags) -> None:
        super().__init__()
        self.q_size = d.num_heads * d.head_dim
        self.kv_size = d.num_kv_heads * d.head_dim
        self.dims = d
        self.qkv_proj = MergedLinear(d.hidden_size, [self.q_size, self.kv_size, self.kv_size], flags.qkv_bias)
        self.o_proj = Linear(self.q_size, d.hidden_size, flags.o_bias)
        self.q_norm = RMSNorm(d.head_dim, d.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(d.head_dim, d.rms_norm_eps) if flags.qk_norm else None
        self.attn = PagedAttention(d.num_heads, d.num_kv_heads, d.head_dim)

    def forward(self, x: torch.Tensor, rope: RotaryInputs, meta: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, d.num_heads, d.head_dim)
        k = k.view(-1, d.num_kv_heads, d.head_dim)
        v = v.view(-1, d.num_kv_heads, d.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, d: LlamaDims, flags: LlamaFlags) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(d.hidden_size, [d.intermediate_size] * 2, flags.mlp_bias)
        self.down_proj = Linear(d.intermediate_size, d.hidden_size, flags.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: LlamaDims, flags: LlamaFlags) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = LlamaAttention(d, flags)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = LlamaMLP(d, flags)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: RotaryInputs,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.forward_with_residual(h, residual)
        h = self.self_attn(h, rope, meta)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Token ids and positions of a flattened batch in, hidden states out; logits on demand."""

    # NOTE: checkpoint tensors that land in a slice of a fused parameter: name -> (fused, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: object, flags: LlamaFlags, max_positions: int) -> None:
        super().__init__()
        d = LlamaDims.from_hf(config, flags)
        self.dims = d
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(d, flags) for _ in range(d.num_layers)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = Linear(d.hidden_size, d.vocab_size)
        if d.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[assignment]
        inv_freq, scaling = inv_freq_for(config, d.head_dim)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, meta)
        if residual is None:
            return self.norm(h)
        return self.norm.forward_with_residual(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]  # type: ignore[union-attr,misc]
