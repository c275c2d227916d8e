"""Sizing and allocating the paged KV pool.

Per layer, K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]`. The pool is
sized from `kv_cache_memory_bytes` (CPU, or CUDA when given), from `gpu_memory_utilization`
after a profiling pass (CUDA), or fixed by `num_kv_blocks`. It must hold one sequence of
`max_model_len`, or the engine refuses to start and says which settings to change.
K/V are stored in the model's dtype, or with `kv_cache_dtype` fp8 in one byte a value
(`float8_e4m3fn` or `float8_e5m2`) with a per-tensor scale per layer (`PagedAttention.k_scale`,
`v_scale`, vLLM's static scales): a block then takes half the bytes of bf16, so the same
memory holds twice the tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pagoda.config import DEFAULT_KV_CACHE_MEMORY, CacheConfig
from pagoda.layers.cpu_kernels import memory

logger = logging.getLogger("pagoda")


KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype: the model's for 'auto', else the fp8 format named."""
    return model_dtype if cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[cache_dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

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


def log_capacity(spec: KVCacheSpec, num_blocks: int, block_size: int, max_model_len: int) -> None:
    tokens = num_blocks * block_size
    gib = num_blocks * spec.block_bytes(block_size) / 1024**3
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s, %d bytes a token)", num_blocks,
                block_size, tokens, gib, str(spec.dtype).removeprefix("torch."), spec.block_bytes(block_size) // block_size)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, tokens / max_model_len)


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
