"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) as one model with flags.

Flags come from the architecture and its config: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), a sliding window (Mistral), tied embeddings; a subclass may give a layer another
feed-forward block (`make_mlp`: Mixtral's and Qwen3-MoE's experts, models/moe.py). The model
is free of quantization and cache-management code: it reads the `AttentionMetadata` it is
given. Tensor parallelism hides in its layers (layers/tensor_parallel.py: each holds its
rank's shard, given an explicit `ParallelGroup`); a pipeline stage (`PipelineStage`) builds
only its own decoder layers, the first the embedding, the last the final norm and LM head.
With the defaults it is the whole model on one process.
Layers carry the residual stream separately (vLLM's layout), so that "add the residual, then
normalize" is one step (`RMSNorm.forward_with_residual`); the sums are those of Hugging Face's
`h = h + f(norm(h))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagoda.distributed.group import SINGLE, WHOLE, ParallelGroup, PipelineStage
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import PagedAttention
from pagoda.layers.attention_backend import AttentionMetadata
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, RotaryInputs, inv_freq_for
from pagoda.layers.tensor_parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class FusedLayers(Protocol):
    """Every decoder layer of a step in one call (the runner's `NativeDecoder`), for the steps
    it `takes`; the model runs its own layers for the others."""

    def takes(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]: ...


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
    def __init__(self, d: LlamaDims, flags: LlamaFlags, tp: ParallelGroup) -> None:
        super().__init__()
        self.num_heads = tp.shard(d.num_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(d.num_kv_heads, "num_key_value_heads")[1]
        self.q_size = self.num_heads * d.head_dim
        self.kv_size = self.num_kv_heads * d.head_dim
        self.dims = d
        q_total, kv_total = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.qkv_proj = MergedColumnParallelLinear(d.hidden_size, [q_total, kv_total, kv_total],
                                                   flags.qkv_bias, tp)
        self.o_proj = RowParallelLinear(q_total, d.hidden_size, flags.o_bias, tp)
        self.q_norm = RMSNorm(d.head_dim, d.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(d.head_dim, d.rms_norm_eps) if flags.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d.head_dim,
                                   sliding_window=d.sliding_window)

    def forward(self, x: torch.Tensor, rope: RotaryInputs, meta: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, d.head_dim)
        k = k.view(-1, self.num_kv_heads, d.head_dim)
        v = v.view(-1, self.num_kv_heads, d.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, d: LlamaDims, flags: LlamaFlags, tp: ParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(d.hidden_size, [d.intermediate_size] * 2,
                                                       flags.mlp_bias, tp)
        self.down_proj = RowParallelLinear(d.intermediate_size, d.hidden_size, flags.mlp_bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention, then the feed-forward block: `mlp`, a dense `LlamaMLP` unless the model gives
    another (a sparse mixture of experts, models/moe.py)."""

    def __init__(self, d: LlamaDims, flags: LlamaFlags, tp: ParallelGroup, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = LlamaAttention(d, flags, tp)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = LlamaMLP(d, flags, tp) if mlp is None else mlp

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


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage runs (no parameters here)."""


# (hidden states, residual stream) between pipeline stages
Intermediate = tuple[torch.Tensor, torch.Tensor | None]


class DecoderOnlyLM(nn.Module):
    """What every decoder-only model here shares: fused checkpoint names, which checkpoint
    tensors a pipeline stage holds, and the final norm. Subclasses build the modules."""

    # NOTE: checkpoint tensors that land in a slice of a fused parameter: name -> (fused, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    embed_tokens: VocabParallelEmbedding | None
    layers: nn.ModuleList
    norm: nn.Module | None
    lm_head: ParallelLMHead | None
    tie_word_embeddings: bool

    def build_stage(self, vocab_size: int, hidden_size: int, tie_word_embeddings: bool, num_layers: int,
                    make_layer: Callable[[int], nn.Module], make_norm: Callable[[], nn.Module],
                    tp: ParallelGroup, stage: PipelineStage) -> None:
        """This stage's modules: the embedding on the first, its own layers (MissingLayer for
        the others'), the final norm and LM head on the last (tied where the checkpoint ties)."""
        self.stage = stage
        self.tie_word_embeddings = tie_word_embeddings
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, tp) if stage.is_first else None
        self.layers = nn.ModuleList([make_layer(i) if stage.owns_layer(i, num_layers) else MissingLayer()
                                     for i in range(num_layers)])
        self.norm = make_norm() if stage.is_last else None
        self.lm_head = ParallelLMHead(hidden_size, vocab_size, tp) if stage.is_last else None
        if tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.embed_tokens.tie(self.lm_head)

    def finish(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | Intermediate:
        """The final norm over the residual stream, or (not the last stage) the stream as is."""
        if self.norm is None:
            return h, residual
        if residual is None:
            return self.norm(h)
        return self.norm.forward_with_residual(h, residual)[0]  # type: ignore[operator]

    def has_checkpoint_tensor(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor `name` (layers of other stages and
        the ends it lacks are skipped at load time)."""
        if name.startswith("layers."):
            return not isinstance(self.layers[int(name.split(".")[1])], MissingLayer)
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None or (self.tie_word_embeddings and self.lm_head is not None)
        if name.startswith(("norm.", "lm_head.")):
            return self.norm is not None
        return True


class LlamaForCausalLM(DecoderOnlyLM):
    """Token ids and positions of a flattened batch in, hidden states out; logits on demand."""

    def __init__(self, config: object, flags: LlamaFlags, max_positions: int,
                 tp: ParallelGroup = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        d = LlamaDims.from_hf(config, flags)
        self.dims = d
        self.build_stage(d.vocab_size, d.hidden_size, d.tie_word_embeddings, d.num_layers,
                         lambda i: LlamaDecoderLayer(d, flags, tp, self.make_mlp(config, d, flags, tp, i)),
                         lambda: RMSNorm(d.hidden_size, d.rms_norm_eps), tp, stage)
        inv_freq, scaling = inv_freq_for(config, d.head_dim)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)

    def make_mlp(self, config: object, d: LlamaDims, flags: LlamaFlags, tp: ParallelGroup,
                 layer: int) -> nn.Module | None:
        """Layer `layer`'s feed-forward block; None: the dense `LlamaMLP` (a subclass's seat)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Intermediate | None = None,
                fused: FusedLayers | None = None) -> torch.Tensor | Intermediate:
        """The final hidden states; a stage that is not the last returns its `Intermediate`,
        and one that is not the first takes the previous stage's instead of `input_ids`.
        `fused`, when it takes the step, runs every layer in one call."""
        if intermediate is None:
            assert self.embed_tokens is not None
            h, residual = self.embed_tokens(input_ids), None
        else:
            h, residual = intermediate
        if fused is not None and fused.takes(h, positions, meta):
            h, residual = fused(h, residual, positions, meta)
        else:
            rope = self.rotary(positions, h.dtype)
            for layer in self.layers:
                if not isinstance(layer, MissingLayer):
                    h, residual = layer(h, residual, rope, meta)
        return self.finish(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers  # type: ignore[union-attr,misc]
                if not isinstance(layer, MissingLayer)]
