"""LLMEngine: add_request / abort_request / step over the scheduler and the model runner.

One step: schedule -> run the model -> sample -> append tokens and apply stop rules ->
free finished requests -> emit `RequestOutput` deltas and stats.

One request never fails another: inputs are validated once, by `InputProcessor`, before they
reach the core; a step whose model call fails is rerun a request at a time
(`isolation.py`) and only the requests that fail alone are failed (with their siblings of
the same user request); an error while appending one request's token fails only it; a broken
stat logger is logged and skipped.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig
from pagoda.engine_setup import EngineParts
from pagoda.executor import build_engine_parts
from pagoda.input_processor import EngineRequest, InputProcessor, PromptTooLongError
from pagoda.isolation import StepResult, execute_isolating, untrusted_blocks, uses_any
from pagoda.metrics.base import StatLoggerBase
from pagoda.output_processor import RequestState, finished_stats, record_token_timing
from pagoda.outputs import RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.spec_decode import build_proposer
from pagoda.spec_decode.eligibility import trim_to_grammar
from pagoda.stats import IterationStats, SchedulerStats, SpecDecodingStats
from pagoda.structured_output import GrammarError

logger = logging.getLogger("pagoda")

__all__ = ["LLMEngine", "PromptTooLongError", "EngineStuckError"]

# NOTE: steps in a row in which every one of several requests failed, each alone too: no
# request's input can do that to the others, the engine itself cannot compute (a lost device).
MAX_STUCK_STEPS = 3


class EngineStuckError(RuntimeError):
    """Step after step fails for every request: the engine, not a request, is broken."""

    fatal = True


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLoggerBase] = ()) -> None:
        parts: EngineParts = build_engine_parts(config)
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.max_model_len = parts.config.scheduler.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.block_bytes = parts.block_bytes
        self.processor = InputProcessor(parts.tokenizer, parts.vocab_size, self.max_model_len,
                                        parts.config.limits, config.scheduler.scheduling_policy)
        self.block_manager = BlockManager(parts.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.states: dict[str, RequestState] = {}
        self.stat_loggers = list(stat_loggers)
        self.info = parts.info
        for stat_logger in self.stat_loggers:
            stat_logger.record_engine_info(parts.info)
        self.proposer = build_proposer(self.config.speculative, self.config, parts.vocab_size)
        self._ids = itertools.count()
        self._pending_stats = IterationStats()
        self.last_scheduler_stats = self.scheduler_stats()
        self._num_stuck_steps = 0

    @classmethod
    def from_engine_args(cls, model: str = "smollm2", stat_loggers: Sequence[StatLoggerBase] = (),
                         **kwargs: object) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs), stat_loggers)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Validates and queues a request; returns its id.

        Raises:
            ValueError: an invalid prompt or params (`param` names the field), or an id in use.
            PromptTooLongError: no room for one output token.
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        self._check_new_id(request_id)
        return self.add_processed(self.processor.process(request_id, prompt, params, arrival_time,
                                                         priority=priority))

    def add_processed(self, req: EngineRequest) -> str:
        """Queues a request that `self.processor` already validated; returns its id."""
        self._check_new_id(req.request_id)
        params = req.sampling_params
        grammars = [req.grammar] + [req.grammar.fork() if req.grammar else None
                                    for _ in range(params.n - 1)]
        children = [
            Request(req.request_id, req.prompt_token_ids,
                    params.for_child(i) if params.n > 1 else params, self.eos_token_ids,
                    req.arrival_time, self.max_model_len, sample_index=i, grammar=grammars[i],
                    priority=req.priority, group=req.group)
            for i in range(params.n)
        ]
        self.states[req.request_id] = RequestState(req.request_id, req.prompt, children,
                                                   self.tokenizer)
        for child in children:
            self.scheduler.add_request(child)
        return req.request_id

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.states:
            raise ValueError(f"Request id {request_id!r} is already in use.")

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

    def record_rejection(self, reason: str) -> None:
        """Counts a request the frontend refused (e.g. a full queue) in the next stats."""
        rejected = self._pending_stats.rejected_requests
        rejected[reason] = rejected.get(reason, 0) + 1
        if not self.states:
            self._record(self._pending_stats)
            self._pending_stats = IterationStats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.time()
        stats, self._pending_stats = self._pending_stats, IterationStats()
        self._propose()
        sched = self.scheduler.schedule()
        stats.num_preemptions = len(sched.preempted)
        stats.num_scheduled_tokens = sched.total_num_scheduled_tokens
        if sched.requests:
            self._run(sched, stats)
        outputs = self._collect_outputs()
        stats.step_duration = time.time() - start
        self._record(stats)
        return outputs

    def _propose(self) -> None:
        """Drafts tokens for the running requests, unless the batch is too large to gain."""
        spec = self.config.speculative
        running = self.scheduler.running
        if self.proposer is None or not running or spec is None:
            return
        if spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size:
            return
        try:
            self.proposer.propose(running)
            trim_to_grammar(running)
        except Exception:  # noqa: BLE001 - without drafts every request still decodes
            logger.exception("Drafting failed; this step runs without speculation")
            for request in running:
                request.spec_token_ids = []

    def _run(self, sched: SchedulerOutput, stats: IterationStats) -> None:
        result = execute_isolating(self.runner, sched)
        self._check_stuck(sched, result)
        untrusted = untrusted_blocks(result.failed, self.block_manager.block_size)
        for request, exc in result.failed:
            self._fail(request, exc, stats)
        ran = SchedulerOutput()
        for request, num_tokens in result.executed:
            if uses_any(request, untrusted):
                self.scheduler.preempt(request)
                stats.num_preemptions += 1
                result.samples.pop(request, None)
            else:
                ran.add(request, num_tokens - self._rejected_drafts(request, result, stats))
        self.scheduler.update_from_output(ran)
        now = time.time()
        for request, (tokens, logprobs) in result.samples.items():
            try:
                for token in tokens:
                    self._append(request, token, logprobs, now, stats)
                    if request.is_finished:
                        break
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error: fail only it
                self._fail(request, exc, stats)
        for request, _ in result.executed:
            request.spec_token_ids = []

    def _check_stuck(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Raises `EngineStuckError` after `MAX_STUCK_STEPS` steps in a row in which every one
        of two or more requests failed alone as well (failing them all forever while the
        health check says ok would be a lie)."""
        everyone = len(sched.requests) >= 2 and len(result.failed) == len(sched.requests)
        self._num_stuck_steps = self._num_stuck_steps + 1 if everyone else 0
        if self._num_stuck_steps >= MAX_STUCK_STEPS:
            exc = result.failed[-1][1]
            raise EngineStuckError(f"{MAX_STUCK_STEPS} steps in a row failed for every request, each "
                                   f"alone too ({type(exc).__name__}: {exc})") from exc

    def _rejected_drafts(self, request: Request, result: StepResult,
                         stats: IterationStats) -> int:
        """How many of the request's scheduled drafts its verification rejected.

        NOTE: their KV slots hold rejected tokens; not counting them as computed rolls them
        back (the next steps overwrite them), and blocks are named only from real tokens.
        """
        drafts = len(request.spec_token_ids)
        if not drafts or request not in result.samples:
            return 0
        accepted = len(result.samples[request][0]) - 1
        if stats.spec_decoding is None:
            stats.spec_decoding = SpecDecodingStats()
        stats.spec_decoding.observe(drafts, accepted)
        return drafts - accepted

    def _append(self, request: Request, token: int, logprobs: dict | None, now: float,
                stats: IterationStats) -> None:
        request.append_token(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token][0]
        record_token_timing(request, now, stats)
        if request.grammar is not None and not request.grammar.accept(token):
            # NOTE: the sampler masks every token the grammar rejects, so a rejected token means
            # the mask left none of the model's tokens: the constraint cannot go on here.
            raise GrammarError(f"no token of this model's vocabulary can continue the constraint "
                               f"(sampled token {token}: {request.grammar.error or 'not allowed'})")
        sample = self.states[request.request_id].samples[request.sample_index]
        stopped_by_string = sample.add_token(token)
        if stopped_by_string:
            request.stop_reason = sample.detok.stop_reason
            self._finish(request, RequestStatus.FINISHED_STOPPED, stats)
        elif (status := request.check_stop()) is not None:
            self._finish(request, status, stats)
        elif request.grammar is not None and request.grammar.terminated:
            self._finish(request, RequestStatus.FINISHED_STOPPED, stats)

    def _fail(self, request: Request, exc: Exception, stats: IterationStats) -> None:
        logger.error("Request %s (sample %d) failed: %s: %s", request.request_id,
                     request.sample_index, type(exc).__name__, exc, exc_info=exc)
        reason = type(exc).__name__
        stats.failed_requests[reason] = stats.failed_requests.get(reason, 0) + 1
        state = self.states.get(request.request_id)
        if state is None:
            self._finish(request, RequestStatus.FINISHED_ERROR, stats)
            return
        state.error = f"{reason}: {exc}"
        state.error_is_request = isinstance(exc, GrammarError)
        for sample in state.samples:  # NOTE: the user request has failed as a whole.
            self._finish(sample.request, RequestStatus.FINISHED_ERROR, stats)

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
            num_blocks_touched=bm.num_blocks_touched,
        )

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
            "pool_bytes_touched": s.num_blocks_touched * block_bytes,
        }

    def shutdown(self) -> None:
        """Stops what runs beside the engine (parallel workers, grammar compilers); idempotent."""
        self.processor.close()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def check_integrity(self) -> None:
        """Asserts the block pool's invariants (tests and idle engines call it)."""
        self.block_manager.check()
        if not self.has_unfinished_requests():
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "leaked KV blocks"

