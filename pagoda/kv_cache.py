"""Sizing and allocating the paged KV pool.

Per layer, K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]`. The pool is
sized from `kv_cache_memory_bytes` (CPU, or CUDA when given), from `gpu_memory_utilization`
after a profiling pass (CUDA), or fixed by `num_kv_blocks`. It must hold one sequence of
`max_model_len`, or the engine refuses to start and says which settings to change.
K/V are stored in the model's dtype, or with `kv_cache_dtype` fp8 in one byte a value
(`float8_e4m3fn` or `float8_e5m2`) with a per-tensor scale per layer (`PagedAttention.k_scale`,
`v_scale`, vLLM's static scales): a block then takes half the bytes of bf16, so the same
memory holds twice the tokens.

A model mixing global and sliding-window layers (Gemma 3) gets two KV cache groups
(`kv_cache_groups`), each with its own pool: the global layers' holds every token, the
windowed layers' only the blocks their window still sees (kv_cache_manager.py). The memory is
split between them by what one `max_model_len` sequence needs of each (`num_blocks_for_groups`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from pagoda.config import DEFAULT_KV_CACHE_MEMORY, CacheConfig, SchedulerConfig
from pagoda.layers.cpu_kernels import memory

logger = logging.getLogger("pagoda")


KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype: the model's for 'auto', else the fp8 format named."""
    return model_dtype if cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[cache_dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    """A group of layers sharing block ids: their count, K/V shape and dtype, and their
    sliding window (None: global attention, or a group whose blocks hold every token)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of `num_tokens` holds while decoding: all of them, or for a
        sliding window those covering its last `window` positions (plus a partial one)."""
        blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, -(-self.sliding_window // block_size) + 1)

    def block_bytes(self, block_size: int) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def num_blocks_for(spec: KVCacheSpec, cache: CacheConfig, device: torch.device,
                   available_cuda_bytes: int | None = None) -> int:
    """How many blocks the pool gets under the cache config."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.type == "cuda" and cache.kv_cache_memory_bytes is None:
        budget = available_cuda_bytes or 0
    else:
        budget = cache.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY
    return max(budget // spec.block_bytes(cache.block_size), 0)


def kv_cache_groups(windows: list[int | None], spec: KVCacheSpec,
                    enable: bool = True) -> list[tuple[KVCacheSpec, list[int]]]:
    """The layers' KV cache groups: each group's spec and layer indices.

    One group for every layer (as `spec` says, its window ignored) unless `enable` and the
    layers mix global attention with one sliding window: then the global layers (group 0)
    and the windowed ones (group 1)."""
    window_set = {w for w in windows if w is not None}
    if not enable or len(window_set) != 1 or None not in windows:
        return [(spec, list(range(len(windows))))]
    window = window_set.pop()
    full = [i for i, w in enumerate(windows) if w is None]
    local = [i for i, w in enumerate(windows) if w is not None]
    return [(dataclasses.replace(spec, num_layers=len(full), sliding_window=None), full),
            (dataclasses.replace(spec, num_layers=len(local), sliding_window=window), local)]


def num_blocks_for_groups(specs: list[KVCacheSpec], cache: CacheConfig, device: torch.device,
                          max_model_len: int, scheduler: SchedulerConfig,
                          available_cuda_bytes: int | None = None) -> list[int]:
    """Each group's block count (one group: `num_blocks_for`).

    With a sliding-window group (group 1): it gets what every seat (`max_num_seqs`) holding
    one window, plus a step's chunk, can use, but never more memory than its layers had in
    one shared pool (so no workload, short or long, fits fewer requests than before), and
    never less than one sequence's window and chunk plus the null block; the full-attention
    group gets the rest. `num_kv_blocks` fixes group 0's count (the old pool's in tokens)."""
    if len(specs) == 1:
        return [num_blocks_for(specs[0], cache, device, available_cuda_bytes)]
    assert len(specs) == 2 and specs[1].sliding_window is not None
    bs = cache.block_size
    full, local = specs
    chunk_blocks = -(-scheduler.max_num_batched_tokens // bs)
    min_local = min(-(-max_model_len // bs), local.blocks_per_sequence(max_model_len, bs) + chunk_blocks) + 1
    seats_local = scheduler.max_num_seqs * local.blocks_per_sequence(max_model_len, bs) + chunk_blocks + 1
    if cache.num_kv_blocks is not None:
        return [cache.num_kv_blocks, max(min_local, min(seats_local, cache.num_kv_blocks + 1))]
    if device.type == "cuda" and cache.kv_cache_memory_bytes is None:
        budget = available_cuda_bytes or 0
    else:
        budget = cache.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY
    full_bytes, local_bytes = full.block_bytes(bs), local.block_bytes(bs)
    shared_local = budget // (full_bytes + local_bytes)  # NOTE: its blocks in one shared pool
    num_local = max(min_local, min(seats_local, shared_local + 1))
    return [max(budget - num_local * local_bytes, 0) // full_bytes, num_local]


def check_capacity(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Raises if one sequence of max_model_len cannot fit, naming the settings to change."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"The KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of "
            f"{block_size}), fewer than one sequence of max_model_len={max_model_len} needs "
            f"({needed} blocks). Increase kv_cache_memory (--kv-cache-memory), "
            "gpu_memory_utilization (--gpu-memory-utilization) or num_kv_blocks "
            "(--num-kv-blocks), or decrease max_model_len (--max-model-len).")


def log_capacity(specs: list[KVCacheSpec], num_blocks: list[int], block_size: int, max_model_len: int) -> None:
    """Logs the pool (per group when there are several) and vLLM's maximum-concurrency line."""
    if len(specs) == 1:
        spec, n = specs[0], num_blocks[0]
        tokens = n * block_size
        gib = n * spec.block_bytes(block_size) / 1024**3
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s, %d bytes a token)", n,
                    block_size, tokens, gib, str(spec.dtype).removeprefix("torch."),
                    spec.block_bytes(block_size) // block_size)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, tokens / max_model_len)
        return
    for spec, n in zip(specs, num_blocks, strict=True):
        kind = f"sliding-window layers (window {spec.sliding_window})" if spec.sliding_window else "full-attention layers"
        logger.info("KV cache, %d %s: %d blocks of %d tokens (%.2f GiB, %s, %d bytes a token)", spec.num_layers,
                    kind, n, block_size, n * spec.block_bytes(block_size) / 1024**3,
                    str(spec.dtype).removeprefix("torch."), spec.block_bytes(block_size) // block_size)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len,
                max_concurrency(specs, num_blocks, block_size, max_model_len))


def max_concurrency(specs: list[KVCacheSpec], num_blocks: list[int], block_size: int, max_model_len: int) -> float:
    """How many sequences of `max_model_len` the groups' pools hold at once (the scarcest
    group's count; a sliding-window pool's null block is no one's)."""
    return min((n - (spec.sliding_window is not None)) / spec.blocks_per_sequence(max_model_len, block_size)
               for spec, n in zip(specs, num_blocks, strict=True))


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                      zero: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V pools per layer.

    `zero` is needed where attention reads padded slots (the torch decode path masks them,
    and a masked NaN would still poison the sum); the CPU kernel reads only written slots, so
    its pool is left untouched and the OS commits memory only as blocks are used (each tensor
    in a mapping of its own: `cpu_kernels.memory.untouched`).
    """
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def make() -> torch.Tensor:
        if zero:
            return torch.zeros(shape, dtype=spec.dtype, device=device)
        if device.type != "cpu":
            return torch.empty(shape, dtype=spec.dtype, device=device)
        nbytes = math.prod(shape) * spec.dtype.itemsize
        return memory.untouched(nbytes).view(spec.dtype).view(shape)

    return [(make(), make()) for _ in range(spec.num_layers)]


class HasBlockTables(Protocol):
    """A request as the engine holds it (request.Request: both groups' tables) or as a worker
    sees it for one step (worker_step.WorkerRequest: group 0's only; parallel ranks keep one group)."""

    block_ids: list[int]


def group_block_ids(request: HasBlockTables, group: int) -> list[int]:
    """The request's block table in KV cache group `group`: 0 `block_ids`, 1 a mixed model's
    `sliding_block_ids` (the sliding-window layers')."""
    return request.block_ids if group == 0 else request.sliding_block_ids  # type: ignore[attr-defined]
