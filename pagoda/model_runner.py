"""ModelRunner: a SchedulerOutput in, sampled tokens out.

`InputPreparer` (model_inputs.py) flattens the batch into `ModelInputs`; `forward` runs the
model (one pipeline stage of it, in a parallel worker) and takes logits only at the rows that
sample (and the prompt rows of requests asking for prompt logprobs, scored by
`prompt_logprobs.py`), and keeps the final-norm hidden rows pooled requests pool
(`pooling.py`); `sample` calls the sampler (and verifies drafts). One process runs
`execute`; every parallel worker (worker.py) runs the same pieces on its shard, on the
requests' copies the engine sends (worker_step.py), and its last stage samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.config import WatermarkConfig
from pagoda.layers import cpu_kernels
from pagoda.layers.attention_backend import (
    AttentionBackend,
    KVCaches,
    LayerKV,
    NativeAttentionBackend,
    TorchAttentionBackend,
)
from pagoda.lora import LoRAError, LoRAManager, LoRARequest
from pagoda.model_inputs import InputPreparer, ModelInputs
from pagoda.models.llama import Intermediate
from pagoda.models.native_decoder import NativeDecoder
from pagoda.models.registry import CausalLM
from pagoda.pooling import pool_chunks
from pagoda.prompt_logprobs import with_prompt_logprobs
from pagoda.request import Request
from pagoda.sampler import Sampler, SamplerOutput
from pagoda.scheduler import SchedulerOutput
from pagoda.spec_decode.rejection import sample_with_drafts
from pagoda.watermark import Watermarker

SMALL_STEP_TOKENS = 12


@dataclass
class LastStageOutput:
    """What the last stage's forward pass keeps: the logits rows, and the final-norm hidden
    rows of the pooled requests (`ModelInputs.pool_rows`)."""

    logits: torch.Tensor
    pooled_hidden: torch.Tensor


def step_threads(num_tokens: int, max_threads: int) -> int:
    """torch's threads for a CPU step of `num_tokens` rows.

    NOTE: with passive OpenMP waits, waking a second thread for each of a small step's ~150
    operations costs more than it saves: one thread decoded a single stream 26% faster here,
    two threads won from about 12 tokens a step (docs/benchmarks.md)."""
    return 1 if num_tokens < SMALL_STEP_TOKENS else max_threads


def attention_backend_for(model: CausalLM, block_size: int, device: torch.device,
                          native: bool) -> AttentionBackend:
    """The native kernels' backend where they run and take every layer's heads, else torch's."""
    if native and all(attn.supports_native for attn in model.attention_layers()):
        return NativeAttentionBackend(block_size)
    return TorchAttentionBackend(block_size, device)


class ModelRunner:
    """Args:
        lora: the LoRA adapters it serves (lora.py), or None.
        watermark: the engine's text watermark (watermark.py), or None.
        logprobs_mode: what `logprobs` report (vLLM's `--logprobs-mode`; the sampler's).
    """

    def __init__(self, model: CausalLM, block_size: int, device: torch.device,
                 lora: LoRAManager | None = None, watermark: WatermarkConfig | None = None,
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.lora = lora
        # NOTE: the whole layer stack in one native call, built once the KV pool is bound.
        self.native_decoder: NativeDecoder | None = None
        self.native_refusal: str | None = None  # why the model has no native decoder stack
        self.kv_caches: KVCaches = {}  # NOTE: every attention layer's K/V pools, once bound
        self.sampler = Sampler(Watermarker(watermark) if watermark is not None else None, logprobs_mode)
        self.use_cpu_kernel = device.type == "cpu" and cpu_kernels.available()

        self.attention_backend = attention_backend_for(model, block_size, device, self.use_cpu_kernel)
        self.preparer = InputPreparer(block_size, device, self.attention_backend)
        self.max_threads = torch.get_num_threads()
        if self.use_cpu_kernel:
            cpu_kernels.ops.set_num_threads(self.max_threads)

    def add_lora(self, request: LoRARequest) -> None:
        """Loads a LoRA adapter now, if it is not loaded (raises `LoRAError` if it cannot be served)."""
        self._lora(request.lora_name).adapter(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a loaded adapter; whether it was loaded."""
        return self._lora(str(lora_int_id)).adapters.pop(lora_int_id, None) is not None

    def _lora(self, name: str) -> LoRAManager:
        if self.lora is None:
            raise LoRAError(f"LoRA adapter {name!r} asked for, but this engine serves none "
                            "(enable_lora / --enable-lora).")
        return self.lora

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      kv_groups: list[int] | None = None) -> None:
        """Takes each attention layer's K/V pools (`kv_caches`, the runner's: each step's metadata
        carries them to the layers, nothing is set on the model); `kv_groups` gives each layer's
        KV cache group (whose block table it reads: kv_cache_manager.py), all 0 when not given."""
        groups = kv_groups or [0] * len(kv_caches)
        self.kv_caches = {attn: LayerKV(k, v, group) for attn, (k, v), group
                          in zip(self.model.attention_layers(), kv_caches, groups, strict=True)}
        self.attention_backend.bind(self.kv_caches)
        self.preparer.num_kv_groups = max(groups, default=0) + 1
        if self.use_cpu_kernel:
            made = NativeDecoder.make(self.model, self.kv_caches)
            self.native_decoder, self.native_refusal = (made, None) if isinstance(made, NativeDecoder) else (None, made)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Runs one step; returns the requests that sampled and their tokens (with the prompt
        logprobs scored and the pooled parts, when some request asked)."""
        sampling, inputs = self.preparer.prepare(out)
        result = self.forward(inputs)
        assert isinstance(result, LastStageOutput)
        return self.sample(out, sampling, inputs, result)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs,
                intermediate: Intermediate | None = None) -> LastStageOutput | Intermediate:
        """The model on one step's inputs: logits at `inputs.logits_rows` and the final-norm
        hidden states at `inputs.pool_row_ids`; a pipeline stage before the last (given the
        previous stage's `intermediate` unless it is the first) returns its hidden states and
        residual instead."""
        self._set_threads(inputs.num_tokens)
        if inputs.lora_rows and self.lora is not None:
            # NOTE: the native stack adds the adapters' updates inside its call; for steps it
            # does not take, they hook the projections, layer by layer in torch.
            with self.lora.step(inputs.lora_rows, self.device):
                fused = (self.native_decoder.adapted(inputs.lora_rows, self.lora.adapter)
                         if self.native_decoder is not None else None)
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, intermediate, fused=fused)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, intermediate,
                                fused=self.native_decoder)
        if isinstance(hidden, tuple):
            return hidden
        pooled = hidden[inputs.pool_row_ids] if inputs.pool_rows else hidden[:0]
        if not inputs.logits_rows.numel():
            return LastStageOutput(hidden.new_empty(0, self.model.dims.vocab_size), pooled)
        return LastStageOutput(self.model.compute_logits(hidden[inputs.logits_rows]), pooled)

    def logits(self, inputs: ModelInputs) -> torch.Tensor:
        """The logits at `inputs.logits_rows` of a whole model (one process; benchmarks, tests)."""
        result = self.forward(inputs)
        assert isinstance(result, LastStageOutput)
        return result.logits

    def sample(self, out: SchedulerOutput, sampling: list[Request], inputs: ModelInputs,
               stage: LastStageOutput) -> tuple[list[Request], SamplerOutput | None]:
        """The step's tokens from its logits (drafts verified), its prompt logprobs and its
        pooled parts."""
        if not sampling and not inputs.prompt_rows and not inputs.pool_rows:
            return [], None
        logits = stage.logits.cpu() if self.device.type != "cpu" else stage.logits
        num = inputs.num_sample_rows
        result = (sample_with_drafts(self.sampler, logits[:num], sampling, [out.drafts(r) for r in sampling])
                  if sampling else None)
        result = with_prompt_logprobs(result, logits[num:], out.requests, inputs.prompt_rows)
        if inputs.pool_rows:
            result = result if result is not None else SamplerOutput([], [])
            result.pooled = pool_chunks(stage.pooled_hidden, out.requests, inputs.pool_rows)
        return sampling, result

    def _set_threads(self, num_tokens: int) -> None:
        if self.device.type != "cpu":
            return
        threads = step_threads(num_tokens, self.max_threads)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def restore_threads(self) -> None:
        """Gives torch back its full thread count (an offline run ends; others may follow)."""
        if torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)
