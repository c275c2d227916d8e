"""LLMEngine: the frontend over an `EngineCore`: add_request / abort_request / step.

One step: the core schedules, runs the model, samples, appends tokens and applies its stop
rules (EOS, stop token ids, length, grammars); here its new tokens are detokenized, stop
strings end their sequences (the core is told at once, before the next step), and
`RequestOutput` deltas and stats go out.

One request never fails another: inputs are validated once, by `InputProcessor`, before they
reach the core; the core isolates a failing model step (see `engine_core.py`); an error while
detokenizing one request fails only it; a broken stat logger is logged and skipped.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig, ModelConfig
from pagoda.core_client import CoreProcessClient
from pagoda.engine_core import EngineCore, EngineCoreOutput, EngineStuckError
from pagoda.engine_setup import EngineParts
from pagoda.executor import build_engine_parts
from pagoda.generation_config import GenerationDefaults, load_generation_defaults
from pagoda.input_processor import EngineRequest, InputProcessor, PromptTooLongError
from pagoda.kv_cache import max_concurrency
from pagoda.kv_cache_manager import HybridBlockManager
from pagoda.lora import LoRARequest
from pagoda.metrics.base import StatLoggerBase
from pagoda.models.loader import is_gguf, resolve_model_path
from pagoda.output_processor import RequestState
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler
from pagoda.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagoda")

__all__ = ["LLMEngine", "PromptTooLongError", "EngineStuckError"]


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLoggerBase] = ()) -> None:
        # NOTE: read first, so that a bad generation config fails before the weights load.
        self.generation_defaults = model_generation_defaults(config.model)
        self.core: EngineCore | CoreProcessClient
        if config.parallel.core_process:
            self.core = CoreProcessClient(config)
            parts: EngineParts = self.core.parts
        else:
            parts = build_engine_parts(config)
            self.core = EngineCore(parts, parts.eos_token_ids)
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len = parts.config.scheduler.max_model_len
        self.block_bytes = parts.block_bytes
        self.kv_pool_bytes = parts.kv_pool_bytes
        self.kv_specs, self.kv_num_blocks = parts.kv_specs, parts.kv_num_blocks
        self.processor = InputProcessor(parts.tokenizer, parts.vocab_size, self.max_model_len,
                                        parts.config.limits, config.scheduler.scheduling_policy,
                                        parts.pooler, parts.config.watermark, parts.config.reasoning)
        self.states: dict[str, RequestState] = {}
        self.stat_loggers = list(stat_loggers)
        self.info = parts.info
        for stat_logger in self.stat_loggers:
            stat_logger.record_engine_info(parts.info)
        self._ids = itertools.count()
        self.last_scheduler_stats = self.scheduler_stats()

    @classmethod
    def from_engine_args(cls, model: str = "smollm2", stat_loggers: Sequence[StatLoggerBase] = (),
                         **kwargs: object) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs), stat_loggers)

    # NOTE: the core's parts, read by tests, benchmarks and the KV report; nothing here
    # changes them. The runner is None when the core runs in its own process.
    @property
    def runner(self):  # noqa: ANN201
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self._local_core().scheduler

    @property
    def block_manager(self) -> BlockManager | HybridBlockManager:
        return self._local_core().block_manager

    @property
    def proposer(self):  # noqa: ANN201
        return self._local_core().proposer

    def _local_core(self) -> EngineCore:
        if not isinstance(self.core, EngineCore):
            raise RuntimeError("The engine core runs in its own process (core_process): its "
                               "scheduler, KV pool and proposer are not reachable from here.")
        return self.core

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Validates and queues a request; returns its id (`cache_salt`: vLLM's; only requests
        with the same salt share cached prefixes; `lora_request`: the LoRA adapter it runs with).

        Raises:
            ValueError: an invalid prompt or params (`param` names the field), or an id in use.
            PromptTooLongError: no room for one output token.
        """
        request_id = request_id if request_id is not None else self.new_id()
        self._check_new_id(request_id)
        return self.add_processed(self.processor.process(request_id, prompt, params, arrival_time,
                                                         priority=priority, cache_salt=cache_salt,
                                                         lora_request=lora_request))

    def new_id(self) -> str:
        """A request id of this engine's own numbering."""
        return str(next(self._ids))

    def add_processed(self, req: EngineRequest) -> str:
        """Queues a request that `self.processor` already validated; returns its id."""
        self._check_new_id(req.request_id)
        metrics = self.core.add_request(req)
        self.states[req.request_id] = RequestState(req.request_id, req.prompt, req.prompt_token_ids,
                                                   req.sampling_params.per_sample(), metrics[0],
                                                   self.tokenizer, self.config.scheduler.stream_interval)
        return req.request_id

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.states:
            raise ValueError(f"Request id {request_id!r} is already in use.")

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads a LoRA adapter now (vLLM's `add_lora`); raises `LoRAError` if it cannot be served."""
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a loaded LoRA adapter (vLLM's `remove_lora`); whether it was loaded."""
        return self.core.remove_lora(lora_int_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (all its samples) and frees its blocks at once."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for out in self.core.abort_request(request_id):
            state.update(out)
        self._record_if_idle()
        return state.make_output()

    def record_rejection(self, reason: str) -> None:
        """Counts a request the frontend refused (e.g. a full queue) in the next stats."""
        self.core.record_rejection(reason)
        self._record_if_idle()

    def _record_if_idle(self) -> None:
        if not self.states:
            # NOTE: no step may follow to carry these stats; record them now.
            self._record(self.core.take_pending_stats())

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def num_waiting_requests(self) -> int:
        return self.core.num_waiting

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.time()
        core_step = self.core.step()
        for out in core_step.outputs:
            self._update(out, core_step.stats)
        outputs = self._collect_outputs()
        core_step.stats.step_duration = time.time() - start
        self._record(core_step.stats)
        return outputs

    def _update(self, out: EngineCoreOutput, stats: IterationStats) -> None:
        state = self.states.get(out.request_id)
        if state is None:
            return
        try:
            if state.update(out):
                # NOTE: a stop string: the core drops the tokens after it before the next step.
                sample = state.samples[out.sample_index]
                self.core.stop_sequence(out.request_id, out.sample_index, len(sample.token_ids), stats)
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error: fail only it
            for final in self.core.fail_request(out.request_id, exc, stats):
                state.update(final)
            # NOTE: the core may have finished the request in this step already.
            state.fail(f"{type(exc).__name__}: {exc}")

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, state in list(self.states.items()):
            out = state.make_output()
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.states[request_id]
        return outputs

    # ---- stats ---------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        return self.core.scheduler_stats()

    def _record(self, stats: IterationStats) -> None:
        self.last_scheduler_stats = sched_stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(sched_stats, stats)
            except Exception:  # noqa: BLE001 - a broken sink must not stop serving
                logger.exception("Stat logger %s failed", type(stat_logger).__name__)

    def kv_report(self, snapshot: SchedulerStats | None = None) -> dict[str, float]:
        """The pool's memory: held, reserved and what contiguous reservation would need.

        Args:
            snapshot: stats to report from (default: the pool as it is now).
        """
        s = snapshot or self.scheduler_stats()
        block_bytes, block_size = self.block_bytes, self.config.cache.block_size
        contiguous_tokens = s.num_running_reqs * self.max_model_len
        report: dict[str, float] = {
            "pool_bytes": self.kv_pool_bytes, "num_blocks": s.num_blocks_total,
            "num_running_requests": s.num_running_reqs,
            "block_size": block_size, "num_blocks_free": s.num_blocks_free,
            "num_blocks_cached": s.num_blocks_cached, "tokens_held": s.num_tokens_held,
            "slots_reserved": s.num_slots_reserved, "slots_unused": s.num_slots_reserved - s.num_tokens_held,
            "contiguous_reservation_tokens": contiguous_tokens,
            "contiguous_reservation_bytes": contiguous_tokens * block_bytes // block_size,
            "pool_bytes_touched": s.num_blocks_touched * block_bytes,
        }
        if self.kv_specs:
            full, local = self.kv_specs
            report.update({
                "max_concurrency": max_concurrency(self.kv_specs, self.kv_num_blocks, block_size,
                                                   self.max_model_len),
                "full_pool_bytes": self.kv_num_blocks[0] * full.block_bytes(block_size),
                "sliding_window": local.sliding_window or 0, "sliding_num_blocks": s.num_sliding_blocks_total,
                "sliding_num_blocks_free": s.num_sliding_blocks_free,
                "sliding_pool_bytes": self.kv_num_blocks[1] * local.block_bytes(block_size),
                # NOTE: what running requests hold in both groups (the sliding null block aside)
                "reserved_bytes": s.num_slots_reserved * full.block_bytes(block_size) // block_size
                + (s.num_sliding_blocks_total - s.num_sliding_blocks_free - 1) * local.block_bytes(block_size),
            })
        return report

    def shutdown(self) -> None:
        """Stops what runs beside the engine (parallel workers, grammar compilers); idempotent."""
        self.processor.close()
        self.core.shutdown()

    def check_integrity(self) -> None:
        """Asserts the block pool's invariants (tests and idle engines call it)."""
        self.core.check_integrity()


def model_generation_defaults(model: ModelConfig) -> GenerationDefaults:
    """The requests' sampling defaults from the model's generation config (a GGUF has none)."""
    path = resolve_model_path(model.model) if model.generation_config == "auto" else None
    folder = path if path is not None and not is_gguf(path) else None
    return load_generation_defaults(model.generation_config, model.override_generation_config, folder)
