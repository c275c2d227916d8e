"""Building an engine's parts from its config: tokenizer, model, KV pool, runner.

Resolves what 'auto' means (device, dtype, max_model_len) and fails early, with the settings
to change, when one sequence of max_model_len cannot fit in the pool.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagoda import heap
from pagoda.config import EngineConfig, SchedulerConfig, WatermarkConfig
from pagoda.distributed.group import SINGLE, WHOLE, ParallelGroup, PipelineStage
from pagoda.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    check_capacity,
    kv_cache_groups,
    log_capacity,
    num_blocks_for_groups,
    resolve_kv_cache_dtype,
)
from pagoda.layers.kernel_plan import KernelPlan
from pagoda.layers.quantization.gptq_awq import resolve_quantization
from pagoda.lora import LoRAManager
from pagoda.model_runner import ModelRunner
from pagoda.models.loader import (
    is_gguf,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from pagoda.pooling import PoolerConfig
from pagoda.stats import EngineInfo
from pagoda.weight_processing import WeightProcessing, process_weights_after_loading

logger = logging.getLogger("pagoda")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    """What the engine is built from. `runner` executes steps: the in-process `ModelRunner`,
    or a `MultiprocExecutor` driving parallel workers; `block_bytes` is one rank's (a block of
    every layer). `kv_specs` and `kv_num_blocks` describe the KV cache groups when a model
    mixing global and sliding-window layers has two (kv_cache.py); empty for one group."""

    config: EngineConfig
    tokenizer: Any
    runner: Any
    num_blocks: int
    block_bytes: int
    eos_token_ids: set[int]
    vocab_size: int
    info: EngineInfo = EngineInfo("", "", "")
    pooler: PoolerConfig = PoolerConfig(0)
    kv_specs: list[KVCacheSpec] = field(default_factory=list)
    kv_num_blocks: list[int] = field(default_factory=list)

    @property
    def kv_pool_bytes(self) -> int:
        """The whole pool's bytes (one rank's)."""
        if not self.kv_specs:
            return self.num_blocks * self.block_bytes
        bs = self.config.cache.block_size
        return sum(n * spec.block_bytes(bs) for spec, n in zip(self.kv_specs, self.kv_num_blocks, strict=True))


KEEP_FLOAT16_ENV = "PAGODA_CPU_FLOAT16"


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device, hf_config: object) -> torch.dtype:
    """'auto' is bfloat16 where the hardware computes it natively, or where pagoda's CPU kernels
    multiply it with vector instructions (AVX2 widens bf16 in registers: half the bytes of fp32
    per token, 2.5x faster decoding on a Zen 3, docs/performance.md), else float32. On such a
    CPU 'float16' (a GPU launch script's `--dtype half`) runs as bfloat16 too, with a warning:
    the kernels take no float16 (KEEP_FLOAT16_ENV=keep keeps it)."""
    if requested == "float16" and device.type == "cpu" and _cpu_bf16_is_fast():
        if os.environ.get(KEEP_FLOAT16_ENV) != "keep":
            logger.warning(
                "--dtype float16 on this CPU runs as bfloat16: pagoda's CPU kernels compute bfloat16 "
                "(the whole layer stack in one native call a step), float16 only layer by layer in "
                "torch, 3-5x slower (docs/benchmarks.md, \"float16 on a CPU\"). bfloat16 keeps "
                "float32's range with 3 fewer mantissa bits. %s=keep serves float16 as asked.",
                KEEP_FLOAT16_ENV)
            return torch.bfloat16
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_bf16_is_fast() else torch.float32


def _cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN) or with pagoda's vector kernels."""
    from pagoda.layers import cpu_kernels

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) or (
        not os.environ.get("PAGODA_DISABLE_CPU_KERNELS") and cpu_kernels.computes_bf16())


def resolve_max_model_len(requested: int | None, hf_config: object) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's "
                         f"max_position_embeddings={limit}.")
    return requested


def eos_token_ids(hf_config: object, tokenizer: object | None) -> set[int]:
    ids: set[int] = set()
    for source in (hf_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def build_model_parts(config: EngineConfig, tp: ParallelGroup = SINGLE,
                      stage: PipelineStage = WHOLE,
                      agree: Callable[[int], int] | None = None) -> EngineParts:
    """Loads the model (this rank's shard and stage) and allocates its KV pool.

    Args:
        agree: parallel ranks agree on one block count (the smallest) through it.
    """
    start = time.time()
    path = resolve_model_path(config.model.model)
    hf_config = load_hf_config(path, config.model.hf_overrides)
    tokenizer = load_tokenizer(path, config.model.chat_template, config.model.tokenizer)
    max_model_len = resolve_max_model_len(config.model.max_model_len, hf_config)
    config = config.with_max_model_len(max_model_len)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device, hf_config)
    torch.manual_seed(config.model.seed)
    quantization = resolve_quantization(config.model.quantization, hf_config)
    if quantization == "fp8":
        from pagoda.layers.quantization.methods import fp8_unsupported_reason

        reason = fp8_unsupported_reason(device)
        if reason:
            raise ValueError(reason)
    # NOTE: this engine's own allocations are counted from here (another engine in this process
    # or on this GPU is not this one's to pay for: vLLM's per-instance gpu_memory_utilization).
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = load_model(path, hf_config, dtype, device, max_model_len, tp, stage,
                       gguf_packed=quantization == "gguf")
    processed = process_weights_after_loading(model, WeightProcessing(
        quantization, config.model.quantization_group_size, device))
    if quantization is None:
        log_gguf_blocks(path, dtype)
    d = model.dims
    layers = model.attention_layers()
    spec = KVCacheSpec(len(layers), layers[0].num_kv_heads, d.head_dim,
                       resolve_kv_cache_dtype(config.cache.cache_dtype, dtype))
    # NOTE: parallel ranks (`agree`) keep one group: their workers carry one table a request.
    groups = kv_cache_groups([attn.sliding_window for attn in layers], spec,
                             enable=agree is None and not config.cache.disable_hybrid_kv_cache_manager)
    specs = [group_spec for group_spec, _ in groups]
    runner = ModelRunner(model, config.cache.block_size, device,
                         LoRAManager(model, config.lora) if config.lora.enable_lora else None,
                         config.watermark, config.model.logprobs_mode)
    num_blocks = num_blocks_for_groups(specs, config.cache, device, max_model_len, config.scheduler,
                                       _available_cuda_bytes(config, runner, spec, device, baseline))
    if agree is not None:
        num_blocks = [agree(num_blocks[0])]
    check_capacity(num_blocks[0], config.cache.block_size, max_model_len)
    runner.bind_kv_cache(*allocate_groups(groups, num_blocks, config.cache.block_size, device,
                                          runner.attention_backend.zeroed_pool))
    log_capacity(specs, num_blocks, config.cache.block_size, max_model_len)
    log_partial_prefills(config.scheduler)
    log_decoder(runner)
    if config.watermark is not None:
        log_watermark(config.watermark)
    heap.freeze_objects()
    # NOTE: loading's temporaries (dequantized and repacked copies) are freed by now but sit in
    # malloc's arenas: handed back, Gemma 3's served RSS drops by ~340 MiB (docs/performance.md).
    heap.trim()
    logger.info("Loaded %s (%s, %s) in %.1f s", path, dtype, device, time.time() - start)
    hybrid = len(groups) > 1
    return EngineParts(config, tokenizer, runner, num_blocks[0], spec.block_bytes(config.cache.block_size),
                       eos_token_ids(hf_config, tokenizer), d.vocab_size, engine_info(device, processed.plan, runner),
                       PoolerConfig.from_hf_config(hf_config), specs if hybrid else [],
                       num_blocks if hybrid else [])


def log_watermark(watermark: WatermarkConfig) -> None:
    """The watermark's settings (never its key), and vLLM's warning on weak deduplication."""
    logger.info("Watermark: %s, context width %d, contexts deduplicated: %s (history %s); "
                "greedy requests and those sending watermarking=false are not watermarked",
                watermark.algorithm, watermark.context_width, watermark.deduplicate_contexts,
                watermark.deduplicate_contexts_max_history or "whole")
    if watermark.weak_deduplication:
        logger.warning("Gumbel-max watermarking with context deduplication disabled or limited to "
                       "fewer than 1024 positions may increase degenerate generations, including "
                       "repetition loops: use deduplicate_contexts 'single_turn' or 'all' with a "
                       "history of at least 1024 (or null).")


def log_partial_prefills(scheduler: SchedulerConfig) -> None:
    """vLLM's line when `max_num_partial_prefills` limits concurrent prefills, with the length
    above which a prompt is long (4% of the context when none was given)."""
    if scheduler.partial_prefills:
        logger.info("Concurrent partial prefills enabled with max_num_partial_prefills=%d, "
                    "max_long_partial_prefills=%d, long_prefill_token_threshold=%d",
                    scheduler.max_num_partial_prefills, scheduler.max_long_partial_prefills,
                    scheduler.prefill_chunk_tokens)


def log_decoder(runner: ModelRunner) -> None:
    """Says how decode steps run the decoder layers: the one-call native stack, or layer by
    layer and why (a layer whose weights the stack cannot take costs ~1.3-1.5x a step)."""
    if runner.native_decoder is not None:
        rows = runner.native_decoder.max_rows
        logger.info("Decoder: the native stack, one call a step (%s)",
                    f"steps of up to {rows} rows" if rows < 1 << 30 else "steps of any size")
    elif runner.native_refusal is not None:
        logger.info("Decoder: layer by layer in Python (no native stack: %s)", runner.native_refusal)


def allocate_groups(groups: list[tuple[KVCacheSpec, list[int]]], num_blocks: list[int], block_size: int,
                    device: torch.device, zero: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Every layer's K/V pools (each from its group's pool of `num_blocks`) and its group."""
    num_layers = sum(len(layer_ids) for _, layer_ids in groups)
    caches: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty(0), torch.empty(0))] * num_layers
    layer_groups = [0] * num_layers
    for g, ((group_spec, layer_ids), n) in enumerate(zip(groups, num_blocks, strict=True)):
        for layer, kv in zip(layer_ids, allocate_kv_cache(group_spec, n, block_size, device, zero=zero), strict=True):
            caches[layer], layer_groups[layer] = kv, g
    return caches, layer_groups


def engine_info(device: torch.device, plan: KernelPlan | None, runner: ModelRunner) -> EngineInfo:
    from pagoda.layers import cpu_kernels

    lib = cpu_kernels.library() if device.type == "cpu" else None
    decoder = ("native stack" if runner.native_decoder is not None
               else f"layer by layer: {runner.native_refusal}" if runner.native_refusal is not None else "")
    return EngineInfo(lib.variant if lib is not None else "none", plan.summary() if plan else "",
                      plan.source if plan else "", decoder)


def log_gguf_blocks(path: str, dtype: torch.dtype) -> None:
    """Says when a GGUF's quantized blocks were loaded dequantized (no --quantization gguf), and
    how to keep them packed: vLLM serves a .gguf quantized without being asked."""
    if not is_gguf(path):
        return
    from pagoda.models.gguf import gguf_tensor_types

    kinds = sorted(set(gguf_tensor_types(path).values()) - {"F32", "F16", "BF16"})
    if kinds:
        logger.info("%s holds %s blocks, loaded dequantized to %s; --quantization gguf keeps them packed "
                    "(less memory, faster decoding)", Path(path).name, "/".join(kinds), str(dtype).removeprefix("torch."))


def _available_cuda_bytes(config: EngineConfig, runner: ModelRunner, spec: KVCacheSpec,
                          device: torch.device, baseline: int) -> int | None:
    """GPU memory left for KV under gpu_memory_utilization, after weights and a profiling pass."""
    if device.type != "cuda":
        return None
    peak = profile_forward(runner, spec, config)
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_allocated(device) - baseline
    return cuda_kv_bytes(total, free, config.cache.gpu_memory_utilization, own, peak)


def cuda_kv_bytes(total: int, free: int, utilization: float, own: int, peak: int) -> int:
    """KV bytes for one engine: its share of the GPU (`utilization` x `total`) less what it
    already holds (`own`: weights) and its profiled activation `peak`, as vLLM sizes an
    instance; never more than the memory still free (less the peak), which other engines and
    processes on the GPU may have taken (a warning says so)."""
    share = max(int(total * utilization) - own - peak, 0)
    free_left = max(free - peak, 0)
    if free_left < share:
        logger.warning("KV cache: %.2f GiB free on the GPU, less than gpu_memory_utilization=%.2f leaves "
                       "this engine (%.2f GiB): the pool takes what is free", free_left / 2**30, utilization,
                       share / 2**30)
    return min(share, free_left)


def profile_forward(runner: ModelRunner, spec: KVCacheSpec, config: EngineConfig) -> int:
    """Runs one full-budget prefill on a scratch pool; returns its peak activation bytes (CUDA)."""
    from pagoda.request import Request
    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduler import SchedulerOutput

    device = runner.device
    bs = config.cache.block_size
    num_tokens = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_model_len - 1)
    num_blocks = -(-num_tokens // bs)
    runner.bind_kv_cache(allocate_kv_cache(spec, num_blocks, bs, device))
    request = Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1))
    request.block_ids = list(range(num_blocks))
    sched = SchedulerOutput()
    sched.add(request, num_tokens)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    runner.execute(sched)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    runner.bind_kv_cache([(torch.empty(0), torch.empty(0))] * spec.num_layers)
    if cuda:
        torch.cuda.empty_cache()
    return max(peak, 0)
