"""Attention over the paged KV cache.

`AttentionMetadata` is built once per step by the model runner and passed explicitly to every
layer. The flattened batch holds the rows of the batched call first ("decode" rows), then
prefill chunks (one SDPA call each, causal over the cached context plus the new tokens). K/V
of every scheduled token are written to their slots before attention reads them.
With `native` set (by the runner, on CPU) the slot write is one `reshape_and_cache` call and
every row of the step, decodes and prefill chunks alike, goes to the paged-attention kernel,
which reads K/V in place through the block tables and takes any number of query rows per
sequence (`decode_query_start_loc`): causal over the cached prefix and the new rows, tiled
over keys with an online softmax, prefill tiles scored as small GEMMs (attention.cpp; on a
Zen 3 1.7x SDPA's speed on a chunk over a cached prefix, as fast at 2,048 rows without one,
docs/performance.md). Otherwise torch ops do both.
An fp8 pool (`kv_cache_dtype`) holds K / k_scale and V / v_scale in one byte: the kernels
convert on write and read; the torch paths quantize on write and dequantize what they gather,
and a prefill chunk without cached context attends to its fresh K/V rounded as stored, so
every path sees the same values. Over an fp8 pool, Q and K are first multiplied, head by head,
by the normalized Walsh-Hadamard matrix (`rotate_heads`; QuaRot's idea): Q.K is unchanged, but
the few channels that carry most of a key's magnitude no longer get e4m3's 3-bit mantissa
alone (perplexity +1.11% -> +0.3% against a bf16 pool: docs/benchmarks.md, Quantization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import cpu_kernels

MAX_NATIVE_HEAD_DIM = 256  # NOTE: attention.cpp's kMaxHeadDim: larger heads stay on torch


@dataclass
class PrefillChunk:
    """One sequence's new tokens in this step.

    `slots` gathers the whole context (cached + new) from the cache; it is None when the
    sequence has no cached context, in which case the fresh K/V are used directly.
    `mask` (bool, [query_len, context_len], causal) is None when plain causal attention
    applies; a windowed layer narrows it (`mask_for`).
    """

    query_start: int
    query_len: int
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    num_computed_tokens: int = 0
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The chunk's mask for a layer with this sliding window (None: global), made once a
        step per window: key k is seen from query q when q - window < k <= q."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            c = self.num_computed_tokens
            q_pos = torch.arange(c, c + self.query_len, device=device)[:, None]
            k_pos = torch.arange(c + self.query_len, device=device)[None, :]
            self._window_masks[window] = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return self._window_masks[window]


@dataclass
class AttentionMetadata:
    """Per-step inputs of every attention layer.

    The batched call's rows (`num_decode_tokens`: with the native kernel, every row of the
    step) use either the native kernel (`decode_block_tables`, `decode_seq_lens` with the new
    rows counted, `decode_query_start_loc`: int64, read in place) or the torch path (one row a
    sequence: `decode_slots` gather index + causal `decode_mask`, and `decode_seq_lens`).
    `prefills` are the torch path's. Masks are causal: each layer applies its own sliding
    window (`PagedAttention.sliding_window`), so the layers of one model may differ (Gemma 3).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_query_start_loc: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The torch path's decode mask for a layer with this sliding window (None: global),
        made once a step per window: a row of context length n sees keys n - window .. n - 1."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        if window not in self._window_masks:
            assert self.decode_seq_lens is not None
            device = self.decode_mask.device
            pos = torch.arange(self.decode_mask.shape[-1], device=device)[None, :]
            near = pos > (self.decode_seq_lens.to(device)[:, None] - 1 - window)
            self._window_masks[window] = self.decode_mask & near[:, None, None, :]
        return self._window_masks[window]


class PagedAttention(nn.Module):
    """Scaled dot-product attention reading K/V from a block pool bound by the runner.

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
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.native = False
        # NOTE: per-tensor scales of an fp8 pool (vLLM's static k_scale/v_scale, 1.0 unless
        # set at start-up); unused for a pool in the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def supports_native(self) -> bool:
        """Whether the native kernels take this layer's heads (at most 256 wide)."""
        return self.head_dim <= MAX_NATIVE_HEAD_DIM

    @property
    def rotates_qk(self) -> bool:
        """Whether Q and K are rotated (`rotate_heads`): over an fp8 pool, head_dim a power of two."""
        d = self.head_dim
        return self.k_cache.element_size() == 1 and d <= 256 and d & (d - 1) == 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] (token rows may be strided). Returns [T, H * D].
        Over an fp8 pool q and k may be rotated in place."""
        if self.rotates_qk:
            q, k = self._rotate(q), self._rotate(k)
        n = meta.num_decode_tokens
        if self.native:
            cpu_kernels.ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                              self.k_scale, self.v_scale)
            if n == q.shape[0] and not meta.prefills:
                return self._decode_native(q, meta)
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        if not self.native:
            self._write(k_flat, meta.slot_mapping, k, self.k_scale)
            self._write(v_flat, meta.slot_mapping, v, self.v_scale)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if n:
            out[:n] = self._decode(q[:n], k_flat, v_flat, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_flat, v_flat, chunk).flatten(1)
        return out

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            cpu_kernels.ops.hadamard_inplace(x)
            return x
        return rotate_heads(x)

    def _decode(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_slots is None:
            return self._decode_native(q, meta)
        # NOTE: the query heads sharing a KV head become that head's "query positions", so
        # grouped-query attention needs no K/V expansion: [B, KV, group, D] against [B, KV, L, D].
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys = self._gather(k_flat, meta.decode_slots, self.k_scale, q.dtype).transpose(1, 2)
        values = self._gather(v_flat, meta.decode_slots, self.v_scale, q.dtype).transpose(1, 2)
        queries = q.reshape(batch, self.num_kv_heads, group, self.head_dim)
        o = F.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                           attn_mask=meta.decode_mask_for(self.sliding_window))
        return o.reshape(batch, self.num_heads * self.head_dim)

    def _decode_native(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        assert meta.decode_query_start_loc is not None
        return cpu_kernels.ops.paged_attention(
            q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_seq_lens,
            meta.decode_query_start_loc, self.scale, self.sliding_window or 0, self.k_scale, self.v_scale)

    def _to_cache(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x as the pool stores it: unchanged, or x / scale rounded to fp8 (saturating)."""
        dtype = self.k_cache.dtype
        if dtype == x.dtype:
            return x
        limit = torch.finfo(dtype).max
        return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)

    @staticmethod
    def _from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        if x.dtype == dtype:
            return x
        return (x.float() * scale).to(dtype)

    # NOTE: an fp8 pool is indexed through a uint8 view: index_copy_ and gathers are not
    # implemented for float8 dtypes everywhere (CUDA), byte copies are.
    def _write(self, flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        if flat.dtype == x.dtype:
            flat.index_copy_(0, slots, x)
        else:
            flat.view(torch.uint8).index_copy_(0, slots, self._to_cache(x, scale).view(torch.uint8))

    @classmethod
    def _gather(cls, flat: torch.Tensor, index: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        if flat.dtype == dtype:
            return flat[index]
        return cls._from_cache(flat.view(torch.uint8)[index].view(flat.dtype), scale, dtype)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor,
                 v_flat: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.slots is not None:
            k = self._gather(k_flat, chunk.slots, self.k_scale, q.dtype)
            v = self._gather(v_flat, chunk.slots, self.v_scale, q.dtype)
        elif self.k_cache.dtype != q.dtype:
            # NOTE: fresh K/V as the pool stores them, so that a prompt attends to the same
            # values whether it is prefilled at once, in chunks, or recomputed after preemption.
            k = self._from_cache(self._to_cache(k, self.k_scale), self.k_scale, q.dtype)
            v = self._from_cache(self._to_cache(v, self.v_scale), self.v_scale, q.dtype)
        # NOTE: K/V expanded to every query head and a 4-D call take SDPA's fast CPU path:
        # 2-3x faster here than the 3-D enable_gqa call.
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = chunk.mask_for(self.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )
        return o[0].transpose(0, 1)


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the normalized Walsh-Hadamard matrix (D a power of two), in fp32, rounded
    once to x's dtype. Butterflies of strides 1, 2, 4, ..., then the scale: the operations and
    order of the native kernel (pagoda/csrc/cache.cpp), so both give the same bits."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return (y * (1.0 / math.sqrt(d))).to(x.dtype)
