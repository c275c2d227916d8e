"""Attention backends: how a step's attention metadata is built, and how a layer attends with it.

The model runner picks one backend when it is built (`attention_backend_for`) and hands it to
its input preparer; each step's metadata is built by that backend and passed explicitly to
every layer, which calls `meta.attend(layer, q, k, v)`: nothing on the model says which path
runs. A CUDA backend would be a third class with the same two methods.

- `NativeAttentionBackend` (CPU, pagoda's kernels): every row of the step, decodes and prefill
  chunks alike, goes to one paged-attention kernel call, which reads K/V in place through the
  block tables and takes any number of query rows per sequence (`query_start_loc`): causal
  over the cached prefix and the new rows, tiled over keys with an online softmax, prefill
  tiles scored as small GEMMs (attention.cpp; on a Zen 3 1.7x SDPA's speed on a chunk over a
  cached prefix, as fast at 2,048 rows without one, docs/performance.md). The slot write is
  one `reshape_and_cache` call.
- `TorchAttentionBackend` (any device): one-token decodes first, in one SDPA call over their
  gathered context; then each prefill chunk, one SDPA call, causal over the cached context
  plus its new tokens. K/V of every scheduled token are written to their slots first.

Masks are causal; each layer applies its own sliding window, so the layers of one model may
differ (Gemma 3). Over an fp8 pool the kernels convert on write and read; the torch path
quantizes on write and dequantizes what it gathers, and a prefill chunk without cached context
attends to its fresh K/V rounded as stored, so every path sees the same values.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from pagoda.kv_cache import group_block_ids
from pagoda.layers import cpu_kernels

if TYPE_CHECKING:
    from pagoda.layers.attention import PagedAttention
    from pagoda.request import Request


class AttentionBackend(Protocol):
    # NOTE: whether the KV pool must start zeroed: the torch path gathers whole blocks and masks
    # the unwritten slots, and garbage such as NaN would survive a zero attention weight.
    zeroed_pool: bool

    def batched(self, num_tokens: int) -> bool:
        """Whether a sequence scheduled for `num_tokens` rows joins the batched call (whose
        rows the preparer puts first)."""
        ...

    def build(self, reqs: list[Request], counts: list[int], slot_mapping: torch.Tensor,
              group: int = 0) -> NativeAttentionMetadata | TorchAttentionMetadata:
        """The step's metadata for `reqs` (batched ones first) scheduled for `counts` rows,
        over KV cache group `group`'s block tables."""
        ...

    def bind(self, caches: KVCaches) -> None:
        """The pools the metadata it builds carries (`ModelRunner.bind_kv_cache`)."""
        ...


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's K and V pools and the KV cache group whose block tables it reads
    (kv_cache_manager.py): the runner's, bound once (`ModelRunner.bind_kv_cache`)."""

    k: torch.Tensor
    v: torch.Tensor
    group: int = 0


# NOTE: every attention layer's pools by layer; the runner's, handed to the backend when bound,
# and carried by reference in each step's metadata.
KVCaches = dict["PagedAttention", LayerKV]


def block_table(reqs: list[Request], num_blocks: int, group: int = 0) -> torch.Tensor:
    """[len(reqs), num_blocks] block ids of KV cache group `group` (0-padded)."""
    tables = [group_block_ids(r, group) for r in reqs]
    rows = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
    return torch.tensor(rows, dtype=torch.long)


# ---- native (CPU kernels) ------------------------------------------------------------------
@dataclass
class NativeAttentionMetadata:
    """Every row of the step in one kernel call: per sequence its block table row, its context
    length with the new rows counted, and where its rows start (int64, read in place)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    caches: KVCaches = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def kv_of(self, layer: PagedAttention) -> LayerKV:
        return self.caches[layer]

    @staticmethod
    def rotate(x: torch.Tensor) -> torch.Tensor:
        cpu_kernels.ops.hadamard_inplace(x)
        return x

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        kv = self.caches[layer]
        cpu_kernels.ops.reshape_and_cache(k, v, kv.k, kv.v, self.slot_mapping, layer.k_scale, layer.v_scale)
        return cpu_kernels.ops.paged_attention(
            q, kv.k, kv.v, self.block_tables, self.seq_lens,
            self.query_start_loc, layer.scale, layer.sliding_window or 0, layer.k_scale, layer.v_scale)


class NativeAttentionBackend:
    zeroed_pool = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.caches: KVCaches = {}

    def bind(self, caches: KVCaches) -> None:
        self.caches = caches

    def batched(self, num_tokens: int) -> bool:
        return True

    def build(self, reqs: list[Request], counts: list[int], slot_mapping: torch.Tensor,
              group: int = 0) -> NativeAttentionMetadata:
        lens = [r.num_computed_tokens + n for r, n in zip(reqs, counts, strict=True)]
        table = block_table(reqs, -(-max(lens, default=0) // self.block_size), group)
        return NativeAttentionMetadata(slot_mapping, table, torch.tensor(lens, dtype=torch.long),
                                       torch.tensor([0, *itertools.accumulate(counts)]), self.caches)


# ---- torch (SDPA) --------------------------------------------------------------------------
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
class TorchAttentionMetadata:
    """One-token decodes first (`num_decode_tokens` rows: the `decode_slots` gather index, a
    causal `decode_mask`, `decode_seq_lens`), then `prefills`."""

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    caches: KVCaches = field(default_factory=dict)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def kv_of(self, layer: PagedAttention) -> LayerKV:
        return self.caches[layer]

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The decode mask for a layer with this sliding window (None: global), made once a
        step per window: a row of context length n sees keys n - window .. n - 1."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        if window not in self._window_masks:
            assert self.decode_seq_lens is not None
            device = self.decode_mask.device
            pos = torch.arange(self.decode_mask.shape[-1], device=device)[None, :]
            near = pos > (self.decode_seq_lens.to(device)[:, None] - 1 - window)
            self._window_masks[window] = self.decode_mask & near[:, None, None, :]
        return self._window_masks[window]

    @staticmethod
    def rotate(x: torch.Tensor) -> torch.Tensor:
        return rotate_heads(x)

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        kv = self.caches[layer]
        k_flat = kv.k.view(-1, layer.num_kv_heads, layer.head_dim)
        v_flat = kv.v.view(-1, layer.num_kv_heads, layer.head_dim)
        _write(k_flat, self.slot_mapping, k, layer.k_scale)
        _write(v_flat, self.slot_mapping, v, layer.v_scale)
        n = self.num_decode_tokens
        if n == q.shape[0]:
            return self._decode(layer, q, k_flat, v_flat)  # NOTE: all decodes: no copy into `out`
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        if n:
            out[:n] = self._decode(layer, q[:n], k_flat, v_flat)
        for chunk in self.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = _prefill(layer, q[rows], k[rows], v[rows], k_flat, v_flat, chunk).flatten(1)
        return out

    def _decode(self, layer: PagedAttention, q: torch.Tensor, k_flat: torch.Tensor,
                v_flat: torch.Tensor) -> torch.Tensor:
        # NOTE: the query heads sharing a KV head become that head's "query positions", so
        # grouped-query attention needs no K/V expansion: [B, KV, group, D] against [B, KV, L, D].
        assert self.decode_slots is not None
        batch = q.shape[0]
        group = layer.num_heads // layer.num_kv_heads
        keys = _gather(k_flat, self.decode_slots, layer.k_scale, q.dtype).transpose(1, 2)
        values = _gather(v_flat, self.decode_slots, layer.v_scale, q.dtype).transpose(1, 2)
        queries = q.reshape(batch, layer.num_kv_heads, group, layer.head_dim)
        o = F.scaled_dot_product_attention(queries, keys, values, scale=layer.scale,
                                           attn_mask=self.decode_mask_for(layer.sliding_window))
        return o.reshape(batch, layer.num_heads * layer.head_dim)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a pool of `dtype` stores it: unchanged, or x / scale rounded to fp8 (saturating)."""
    if dtype == x.dtype:
        return x
    limit = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def _from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    return (x.float() * scale).to(dtype)


# NOTE: an fp8 pool is indexed through a uint8 view: index_copy_ and gathers are not
# implemented for float8 dtypes everywhere (CUDA), byte copies are.
def _write(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    if flat.dtype == x.dtype:
        flat.index_copy_(0, slots, x)
    else:
        flat.view(torch.uint8).index_copy_(0, slots, _to_cache(x, flat.dtype, scale).view(torch.uint8))


def _gather(flat: torch.Tensor, index: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if flat.dtype == dtype:
        return flat[index]
    return _from_cache(flat.view(torch.uint8)[index].view(flat.dtype), scale, dtype)


def _prefill(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_flat: torch.Tensor, v_flat: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    if chunk.slots is not None:
        k = _gather(k_flat, chunk.slots, layer.k_scale, q.dtype)
        v = _gather(v_flat, chunk.slots, layer.v_scale, q.dtype)
    elif k_flat.dtype != q.dtype:
        # NOTE: fresh K/V as the pool stores them, so that a prompt attends to the same
        # values whether it is prefilled at once, in chunks, or recomputed after preemption.
        pool = k_flat.dtype
        k = _from_cache(_to_cache(k, pool, layer.k_scale), layer.k_scale, q.dtype)
        v = _from_cache(_to_cache(v, pool, layer.v_scale), layer.v_scale, q.dtype)
    # NOTE: K/V expanded to every query head and a 4-D call take SDPA's fast CPU path:
    # 2-3x faster here than the 3-D enable_gqa call.
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = chunk.mask_for(layer.sliding_window, q.device)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=layer.scale,
    )
    return o[0].transpose(0, 1)


class TorchAttentionBackend:
    zeroed_pool = True

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.caches: KVCaches = {}

    def bind(self, caches: KVCaches) -> None:
        self.caches = caches

    def batched(self, num_tokens: int) -> bool:
        return num_tokens == 1

    def build(self, reqs: list[Request], counts: list[int], slot_mapping: torch.Tensor,
              group: int = 0) -> TorchAttentionMetadata:
        num_decodes = sum(1 for n in counts if self.batched(n))  # NOTE: the batched rows come first
        meta = TorchAttentionMetadata(slot_mapping, num_decodes, caches=self.caches)
        if num_decodes:
            meta.decode_slots, meta.decode_mask, meta.decode_seq_lens = self._decode_tables(reqs[:num_decodes], group)
        start = num_decodes
        for r, n in zip(reqs[num_decodes:], counts[num_decodes:], strict=True):
            meta.prefills.append(self._prefill_chunk(r, start, n, group))
            start += n
        return meta

    def _gather_index(self, table: torch.Tensor, length: int) -> torch.Tensor:
        pos = torch.arange(length)
        return table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_tables(self, reqs: list[Request], group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gather index, causal mask and context lengths of one-token decodes."""
        ctx = torch.tensor([r.num_computed_tokens + 1 for r in reqs])
        length = int(ctx.max())
        table = block_table(reqs, -(-length // self.block_size), group)
        index = self._gather_index(table, length)
        mask = torch.arange(length)[None, :] < ctx[:, None]
        return index.to(self.device), mask[:, None, None, :].to(self.device), ctx.to(self.device)

    def _prefill_chunk(self, r: Request, start: int, n: int, group: int) -> PrefillChunk:
        c = r.num_computed_tokens
        if c == 0:
            return PrefillChunk(query_start=start, query_len=n)
        length = c + n
        mask = torch.arange(length)[None, :] <= torch.arange(c, length)[:, None]
        table = block_table([r], -(-length // self.block_size), group)
        return PrefillChunk(query_start=start, query_len=n, mask=mask.to(self.device),
                            slots=self._gather_index(table, length)[0].to(self.device),
                            num_computed_tokens=c)


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


@dataclass
class GroupedAttentionMetadata:
    """A step's metadata per KV cache group (kv_cache_manager.py): a layer attends through
    its own group's (`LayerKV.group`). In a sliding-window group the blocks that
    left the window are NULL_BLOCK in the tables: the native kernel starts each query's keys
    at its window (attention.cpp), the torch path masks them (block 0 stays zero)."""

    groups: list[NativeAttentionMetadata | TorchAttentionMetadata]

    @property
    def num_tokens(self) -> int:
        return self.groups[0].num_tokens

    def kv_of(self, layer: PagedAttention) -> LayerKV:
        return self.groups[0].kv_of(layer)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups[0].rotate(x)

    def attend(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return self.groups[self.kv_of(layer).group].attend(layer, q, k, v)


AttentionMetadata = NativeAttentionMetadata | TorchAttentionMetadata | GroupedAttentionMetadata
