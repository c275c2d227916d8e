"""Attention over the paged KV cache: the layer.

`PagedAttention` holds one layer's heads, scale, sliding window and fp8 scales; its K/V pools
are the runner's (`ModelRunner.kv_caches`, bound once), reached through each step's metadata.
How it attends is the step's: the attention backend the runner picked builds the metadata each
step (attention_backend.py: the native CPU kernels, or torch's SDPA), and the layer calls
`meta.attend(self, q, k, v)`: nothing is set on the layer from outside.
An fp8 pool (`kv_cache_dtype`) holds K / k_scale and V / v_scale in one byte. Over it, Q and K
are first multiplied, head by head, by the normalized Walsh-Hadamard matrix (`rotate_heads`;
QuaRot's idea; `attention_backend.rotate_heads`): Q.K is unchanged, but the few channels that carry most of a key's magnitude
no longer get e4m3's 3-bit mantissa alone (perplexity +1.11% -> +0.3% against a bf16 pool:
docs/benchmarks.md, Quantization).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagoda.layers.attention_backend import AttentionMetadata

MAX_NATIVE_HEAD_DIM = 256  # NOTE: attention.cpp's kMaxHeadDim: larger heads stay on torch


class PagedAttention(nn.Module):
    """Scaled dot-product attention reading K/V from the runner's block pool (the step's metadata).

    Args:
        scale: the attention scale (default head_dim ** -0.5).
        sliding_window: this layer's window in tokens (key k seen from query q when
            q - window < k <= q), or None for global attention.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or None, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # NOTE: per-tensor scales of an fp8 pool (vLLM's static k_scale/v_scale, 1.0 unless
        # set at start-up); unused for a pool in the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def supports_native(self) -> bool:
        """Whether the native kernels take this layer's heads (at most 256 wide)."""
        return self.head_dim <= MAX_NATIVE_HEAD_DIM

    def rotates_qk(self, pool: torch.Tensor) -> bool:
        """Whether Q and K are rotated (`rotate_heads`) over this K `pool`: an fp8 one, head_dim
        a power of two."""
        d = self.head_dim
        return pool.element_size() == 1 and d <= 256 and d & (d - 1) == 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] (token rows may be strided). Returns [T, H * D].
        Over an fp8 pool q and k may be rotated in place."""
        if self.rotates_qk(meta.kv_of(self).k):
            q, k = meta.rotate(q), meta.rotate(k)
        return meta.attend(self, q, k, v)
