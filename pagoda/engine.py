"""LLMEngine: add_request / abort_request / step over the scheduler and the model runner.

One step: schedule -> run the model -> sample -> append tokens and apply stop rules ->
free finished requests -> emit `RequestOutput` deltas and stats. A step that fails fails only
the requests in it (with an error) and the engine keeps serving the rest.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig
from pagoda.engine_setup import EngineParts, build_engine_parts
from pagoda.metrics.base import StatLoggerBase
from pagoda.output_processor import RequestState, finished_stats, record_token_timing
from pagoda.outputs import RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagoda")


class PromptTooLongError(ValueError):
    """The prompt leaves no room for even one output token."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the input.")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLoggerBase] = ()) -> None:
        parts: EngineParts = build_engine_parts(config)
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.max_model_len = parts.config.scheduler.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.block_bytes = parts.block_bytes
        self.block_manager = BlockManager(parts.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.states: dict[str, RequestState] = {}
        self.stat_loggers = list(stat_loggers)
        self._ids = itertools.count()
        self._pending_stats = IterationStats()
        self.last_scheduler_stats = self.scheduler_stats()

    @classmethod
    def from_engine_args(cls, model: str = "smollm2", stat_loggers: Sequence[StatLoggerBase] = (),
                         **kwargs: object) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs), stat_loggers)

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("This model has no tokenizer: pass prompt token ids.")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queues a request; returns its id.

        Raises:
            ValueError: empty prompt, unknown token ids, or a duplicate id.
            PromptTooLongError: no room for one output token.
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.states:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        children = [
            Request(request_id if params.n == 1 else f"{request_id}#{i}", token_ids,
                    params.for_child(i) if params.n > 1 else params, self.eos_token_ids,
                    arrival_time, self.max_model_len)
            for i in range(params.n)
        ]
        self.states[request_id] = RequestState(request_id, prompt if isinstance(prompt, str) else None,
                                               children, self.tokenizer)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty.")
        vocab = self.runner.model.dims.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token ids out of the vocabulary (size {vocab}): {bad[:5]}.")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (all its samples) and frees its blocks at once."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            self._finish(sample.request, RequestStatus.FINISHED_ABORTED, self._pending_stats)
        out = state.make_output()
        del self.states[request_id]
        if not self.states:
            # NOTE: no step may follow to carry the abort's stats; record them now.
            self._record(self._pending_stats)
            self._pending_stats = IterationStats()
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.time()
        stats, self._pending_stats = self._pending_stats, IterationStats()
        sched = self.scheduler.schedule()
        stats.num_preemptions = len(sched.preempted)
        stats.num_scheduled_tokens = sched.total_num_scheduled_tokens
        if sched.requests:
            self._run(sched, stats)
        outputs = self._collect_outputs()
        stats.step_duration = time.time() - start
        self._record(stats)
        return outputs

    def _run(self, sched: SchedulerOutput, stats: IterationStats) -> None:
        try:
            sampled, result = self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            self._fail(sched, exc, stats)
            return
        self.scheduler.update_from_output(sched)
        if result is None:
            return
        now = time.time()
        for request, token, logprobs in zip(sampled, result.token_ids, result.logprobs, strict=True):
            self._append(request, token, logprobs, now, stats)

    def _append(self, request: Request, token: int, logprobs: dict | None, now: float,
                stats: IterationStats) -> None:
        request.append_token(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token][0]
        record_token_timing(request, now, stats)
        state = self.states[self._parent_id(request)]
        sample = state.samples[self._sample_index(request)]
        stopped_by_string = sample.add_token(token)
        if stopped_by_string:
            request.stop_reason = sample.detok.stop_reason
            self._finish(request, RequestStatus.FINISHED_STOPPED, stats)
        elif (status := request.check_stop()) is not None:
            self._finish(request, status, stats)

    def _fail(self, sched: SchedulerOutput, exc: Exception, stats: IterationStats) -> None:
        logger.exception("Engine step failed; failing the %d requests in it", len(sched.requests))
        reason = type(exc).__name__
        for request in sched.requests:
            state = self.states.get(self._parent_id(request))
            if state is not None:
                state.error = f"{reason}: {exc}"
            self._finish(request, RequestStatus.FINISHED_ERROR, stats)
            stats.failed_requests[reason] = stats.failed_requests.get(reason, 0) + 1

    def _finish(self, request: Request, status: RequestStatus, stats: IterationStats) -> None:
        if request.is_finished:
            return
        self.scheduler.finish_request(request, status)
        request.metrics.finished_time = time.time()
        stats.finished_requests.append(finished_stats(request))

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, state in list(self.states.items()):
            out = state.make_output()
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.states[request_id]
        return outputs

    @staticmethod
    def _parent_id(request: Request) -> str:
        return request.request_id.split("#", 1)[0] if "#" in request.request_id else request.request_id

    @staticmethod
    def _sample_index(request: Request) -> int:
        return int(request.request_id.rsplit("#", 1)[1]) if "#" in request.request_id else 0

    # ---- stats ---------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        bm = self.block_manager
        running = self.scheduler.running
        return SchedulerStats(
            num_running_reqs=len(running), num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage, num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=len(bm.cached), num_tokens_held=sum(r.num_computed_tokens for r in running),
            num_slots_reserved=sum(len(r.block_ids) for r in running) * bm.block_size,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
        )

    def _record(self, stats: IterationStats) -> None:
        self.last_scheduler_stats = sched_stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched_stats, stats)

    def kv_report(self, snapshot: SchedulerStats | None = None) -> dict[str, float]:
        """The pool's memory: held, reserved and what contiguous reservation would need.

        Args:
            snapshot: stats to report from (default: the pool as it is now).
        """
        s = snapshot or self.scheduler_stats()
        block_bytes = self.block_bytes
        contiguous_tokens = s.num_running_reqs * self.max_model_len
        return {
            "pool_bytes": s.num_blocks_total * block_bytes, "num_blocks": s.num_blocks_total,
            "num_running_requests": s.num_running_reqs,
            "block_size": self.block_manager.block_size, "num_blocks_free": s.num_blocks_free,
            "num_blocks_cached": s.num_blocks_cached, "tokens_held": s.num_tokens_held,
            "slots_reserved": s.num_slots_reserved, "slots_unused": s.num_slots_reserved - s.num_tokens_held,
            "contiguous_reservation_tokens": contiguous_tokens,
            "contiguous_reservation_bytes": contiguous_tokens * block_bytes // self.block_manager.block_size,
        }

    def check_integrity(self) -> None:
        """Asserts the block pool's invariants (tests and idle engines call it)."""
        self.block_manager.check()
        if not self.has_unfinished_requests():
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "leaked KV blocks"

