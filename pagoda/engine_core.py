"""EngineCore: the scheduler, the KV pool, the runner (or parallel executor) and the proposer,
behind a typed boundary.

The core takes validated requests (`EngineRequest`: token ids, sampling params, a compiled
grammar, priority, group) and, each `step()`, returns a `CoreStep`: per sequence the token
ids it gained, their logprob ids, the prompt logprobs scored (when asked for), its finish
reason and cached-token count, plus the step's stats. It knows nothing of text:
detokenizing, stop strings and `RequestOutput`s are the frontend's (`LLMEngine` with its
`RequestState`s), which tells the core when a stop string ended a sequence
(`stop_sequence`). Nothing outside reads the core's requests.

One request never fails another: a step whose model call fails is rerun a request at a
time (`isolation.py`) and only the requests that fail alone are failed (with their siblings
of the same user request). Three steps in a row in which every one of several requests failed
alone too raise the fatal `EngineStuckError`: the engine, not a request, is broken.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig
from pagoda.engine_setup import EngineParts
from pagoda.input_processor import EngineRequest
from pagoda.isolation import StepResult, execute_isolating, untrusted_blocks, uses_any
from pagoda.kv_cache_manager import HybridBlockManager
from pagoda.lora import LoRARequest
from pagoda.output_processor import finished_stats, record_token_timing
from pagoda.outputs import RequestMetrics
from pagoda.pooling import PooledPart, finish_vector
from pagoda.request import Request, RequestStatus
from pagoda.sampler import TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.spec_decode import Drafts, build_proposer
from pagoda.spec_decode.eligibility import trim_to_grammar
from pagoda.stats import IterationStats, SchedulerStats, SpecDecodingStats
from pagoda.structured_output import GrammarError
from pagoda.watermark import ContextHistory

logger = logging.getLogger("pagoda")

# NOTE: steps in a row in which every one of several requests failed, each alone too: no
# request's input can do that to the others, the engine itself cannot compute (a lost device).
MAX_STUCK_STEPS = 3


class EngineStuckError(RuntimeError):
    """Step after step fails for every request: the engine, not a request, is broken."""

    fatal = True


@dataclass
class EngineCoreOutput:
    """What one sequence (a request's sample) gained in a step."""

    request_id: str
    sample_index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None  # one entry a token, when asked for
    new_prompt_logprobs: list[TokenLogprobs] | None = None  # prompt positions scored, in order
    finish_reason: RequestStatus | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, or "repetition_detected"
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_is_request: bool = False  # the request's own fault (its constraint), not the engine's
    pooled: list[float] | None = None  # a pooled request's vector, when it finishes (pooling.py)


@dataclass
class CoreStep:
    """One step's outputs (sequences that changed) and stats."""

    outputs: list[EngineCoreOutput]
    stats: IterationStats


def kv_cache_manager_for(parts: EngineParts) -> BlockManager | HybridBlockManager:
    """One block manager, or a mixed model's two KV cache groups' (kv_cache_manager.py)."""
    cache = parts.config.cache
    if len(parts.kv_specs) < 2:
        return BlockManager(parts.num_blocks, cache.block_size, cache.enable_prefix_caching)
    full, local = parts.kv_specs
    return HybridBlockManager(
        BlockManager(parts.kv_num_blocks[0], cache.block_size, cache.enable_prefix_caching),
        BlockManager(parts.kv_num_blocks[1], cache.block_size, False,
                     sliding_window=local.sliding_window, group=1))


class EngineCore:
    """Runs steps over the requests it was given; see the module docstring."""

    def __init__(self, parts: EngineParts, eos_token_ids: set[int]) -> None:
        config: EngineConfig = parts.config
        self.config = config
        self.runner = parts.runner
        self.eos_token_ids = eos_token_ids
        self.max_model_len = config.scheduler.max_model_len
        self.block_manager = kv_cache_manager_for(parts)
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   config.lora.max_loras if config.lora.enable_lora else None)
        self.proposer = build_proposer(config.speculative, config, parts.vocab_size)
        self._requests: dict[str, list[Request]] = {}
        self._changed: dict[tuple[str, int], EngineCoreOutput] = {}
        self._pending_stats = IterationStats()
        self._num_stuck_steps = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> list[RequestMetrics]:
        """Queues a validated request: one sequence per sample (n); returns their metrics
        (timings the core fills in as they run)."""
        if req.request_id in self._requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use.")
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        samples = req.sampling_params.per_sample()
        first = req.grammar.after_thinking(req.reasoning_end) if req.grammar and req.reasoning_end else req.grammar
        grammars = [first] + [first.fork() if first else None for _ in range(len(samples) - 1)]
        children = [
            Request(req.request_id, req.prompt_token_ids, params, self.eos_token_ids,
                    req.arrival_time, self.max_model_len, sample_index=i, grammar=grammars[i],
                    priority=req.priority, group=req.group, pooling_params=req.pooling_params,
                    cache_salt=req.cache_salt, lora_request=req.lora_request,
                    watermark=self._watermark_history(params))
            for i, params in enumerate(samples)
        ]
        self._requests[req.request_id] = children
        for child in children:
            self.scheduler.add_request(child)
        return [child.metrics for child in children]

    def _watermark_history(self, params: SamplingParams) -> ContextHistory | None:
        """A sequence's own watermark contexts, if it carries the engine's watermark."""
        watermark = self.config.watermark
        return ContextHistory(watermark) if watermark is not None and params.watermarking else None

    def add_lora(self, request: LoRARequest) -> None:
        """Loads a LoRA adapter now, if it is not loaded (a bad one is the caller's error: a
        request's, not a step's).

        Raises:
            LoRAError: the engine serves no adapters, or this one cannot be served.
        """
        self.runner.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a loaded adapter (a request still using it loads it again); whether it was loaded."""
        return bool(self.runner.remove_lora(lora_int_id))

    def abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        """Ends every unfinished sequence of a request and frees its blocks at once; returns
        their final outputs (none if the id is unknown)."""
        children = self._requests.pop(request_id, None)
        if children is None:
            return []
        outputs = []
        for request in children:
            if not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED, self._pending_stats)
                outputs.append(self._change(request))
            self._changed.pop(request.key, None)
        return outputs

    def stop_sequence(self, request_id: str, sample_index: int, num_output_tokens: int,
                      stats: IterationStats | None = None) -> None:
        """The frontend found a stop string in the sequence's first `num_output_tokens`
        tokens: the rest are dropped and the sequence finishes as stopped, counted in `stats`
        (the step's, when called right after it) or in the next step's."""
        children = self._requests.get(request_id)
        if children is None or children[sample_index].is_finished:
            return
        request = children[sample_index]
        drop = request.num_output_tokens - num_output_tokens
        if drop > 0:
            del request.output_token_ids[-drop:]
            del request.all_token_ids[-drop:]
        self._finish(request, RequestStatus.FINISHED_STOPPED, stats or self._pending_stats)
        self._changed.pop(request.key, None)
        self._forget_if_done(request_id)

    def fail_request(self, request_id: str, exc: Exception,
                     stats: IterationStats | None = None) -> list[EngineCoreOutput]:
        """Fails a request as a whole (e.g. the frontend could not detokenize it); returns its
        sequences' final outputs."""
        children = self._requests.get(request_id)
        if not children:
            return []
        self._fail(children[0], exc, stats or self._pending_stats)
        self._forget_if_done(request_id)
        return [self._changed.pop(r.key) for r in children if r.key in self._changed]

    def record_rejection(self, reason: str) -> None:
        """Counts a request the frontend refused (e.g. a full queue) in the next stats."""
        rejected = self._pending_stats.rejected_requests
        rejected[reason] = rejected.get(reason, 0) + 1

    def take_pending_stats(self) -> IterationStats:
        """Stats recorded outside a step (aborts, stops, refusals), for an idle engine."""
        stats, self._pending_stats = self._pending_stats, IterationStats()
        return stats

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> CoreStep:
        start = time.time()
        stats = self.take_pending_stats()
        sched = self.scheduler.schedule(self._propose())
        stats.num_preemptions = len(sched.preempted)
        stats.num_scheduled_tokens = sched.total_num_scheduled_tokens
        if sched.requests:
            self._run(sched, stats)
        outputs = list(self._changed.values())
        self._changed.clear()
        for request_id in {o.request_id for o in outputs}:
            self._forget_if_done(request_id)
        stats.step_duration = time.time() - start
        self.scheduler.record_step(sched.total_num_scheduled_tokens, stats.step_duration)
        return CoreStep(outputs, stats)

    def _propose(self) -> Drafts:
        """Drafts tokens for the running requests, unless the batch is too large to gain."""
        spec = self.config.speculative
        running = self.scheduler.running
        if self.proposer is None or not running or spec is None:
            return {}
        if spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size:
            return {}
        try:
            drafts = self.proposer.propose(running)
            trim_to_grammar(drafts)
        except Exception:  # noqa: BLE001 - without drafts every request still decodes
            logger.exception("Drafting failed; this step runs without speculation")
            return {}
        return drafts

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
                result.prompt_logprobs.pop(request, None)
                result.pooled.pop(request, None)
            else:
                ran.add(request, num_tokens - self._rejected_drafts(sched.drafts(request), request,
                                                                    result, stats))
        self.scheduler.update_from_output(ran)
        for request, entries in result.prompt_logprobs.items():
            self._report_prompt_logprobs(request, entries)
        now = time.time()
        for request, part in result.pooled.items():
            self._pool(request, part, now, stats)
        for request, (tokens, logprobs) in result.samples.items():
            try:
                for token in tokens:
                    self._append(request, token, logprobs, now, stats)
                    if request.is_finished:
                        break
            except Exception as exc:  # noqa: BLE001 - e.g. a rejected grammar token: fail only it
                self._fail(request, exc, stats)

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

    def _rejected_drafts(self, draft: list[int], request: Request, result: StepResult,
                         stats: IterationStats) -> int:
        """How many of the request's scheduled drafts (`draft`) its verification rejected.

        NOTE: their KV slots hold rejected tokens; not counting them as computed rolls them
        back (the next steps overwrite them), and blocks are named only from real tokens.
        """
        drafts = len(draft)
        if not drafts or request not in result.samples:
            return 0
        accepted = len(result.samples[request][0]) - 1
        if stats.spec_decoding is None:
            stats.spec_decoding = SpecDecodingStats()
        stats.spec_decoding.observe(drafts, accepted)
        return drafts - accepted

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None, now: float,
                stats: IterationStats) -> None:
        request.append_token(token)
        out = self._change(request)
        out.new_token_ids.append(token)
        if logprobs is not None:
            # NOTE: only reported; the frontend keeps a sample's logprobs and their sum.
            if out.new_logprobs is None:
                out.new_logprobs = []
            out.new_logprobs.append(logprobs)
        record_token_timing(request, now, stats)
        if request.grammar is not None and not request.grammar.accept(token):
            # NOTE: the sampler masks every token the grammar rejects, so a rejected token means
            # the mask left none of the model's tokens: the constraint cannot go on here.
            raise GrammarError(f"no token of this model's vocabulary can continue the constraint "
                               f"(sampled token {token}: {request.grammar.error or 'not allowed'})")
        if (status := request.check_stop()) is not None:
            self._finish(request, status, stats)
        elif request.grammar is not None and request.grammar.terminated:
            self._finish(request, RequestStatus.FINISHED_STOPPED, stats)

    def _report_prompt_logprobs(self, request: Request, entries: list[TokenLogprobs]) -> None:
        """Hands the frontend the prompt positions a step scored (each reported once)."""
        if request.is_finished:
            return
        request.num_prompt_logprobs += len(entries)
        out = self._change(request)
        out.new_prompt_logprobs = (out.new_prompt_logprobs or []) + entries

    def _pool(self, request: Request, part: PooledPart, now: float, stats: IterationStats) -> None:
        """Adds a step's part to the request's pooled vector; once its whole prompt is
        computed, the request finishes with the vector (its first and only "token")."""
        if request.is_finished or request.pooling_params is None:
            return
        # NOTE: parts follow each other (`positions_to_pool` starts past the rows pooled).
        request.pooled_sum = part.total if request.pooled_sum is None else request.pooled_sum + part.total
        request.num_pooled_tokens = part.start + part.count
        if request.num_computed_tokens < request.num_prompt_tokens:
            return
        params = request.pooling_params
        num_rows = request.num_pooled_tokens if params.pools_every_row else 1
        vector = finish_vector(request.pooled_sum, num_rows, params)
        request.metrics.first_token_time = request.metrics.last_token_time = now
        stats.time_to_first_tokens.append(now - request.metrics.arrival_time)
        stats.num_prompt_tokens += request.num_prompt_tokens
        self._finish(request, RequestStatus.FINISHED_STOPPED, stats)
        self._change(request).pooled = vector

    def _change(self, request: Request) -> EngineCoreOutput:
        """The output this step reports for `request`, created on first change."""
        out = self._changed.get(request.key)
        if out is None:
            out = self._changed[request.key] = EngineCoreOutput(
                request.request_id, request.sample_index, metrics=request.metrics)
        out.num_cached_tokens = request.num_cached_tokens
        if request.is_finished:
            out.finish_reason = request.status
            out.stop_reason = request.stop_reason
        return out

    def _fail(self, request: Request, exc: Exception, stats: IterationStats) -> None:
        logger.error("Request %s (sample %d) failed: %s: %s", request.request_id,
                     request.sample_index, type(exc).__name__, exc, exc_info=exc)
        reason = type(exc).__name__
        stats.failed_requests[reason] = stats.failed_requests.get(reason, 0) + 1
        # NOTE: the user request fails as a whole: every sample ends with the error.
        for sample in self._requests.get(request.request_id, [request]):
            self._finish(sample, RequestStatus.FINISHED_ERROR, stats)
            out = self._change(sample)
            out.error = f"{reason}: {exc}"
            out.error_is_request = isinstance(exc, GrammarError)

    def _finish(self, request: Request, status: RequestStatus, stats: IterationStats) -> None:
        if request.is_finished:
            return
        self.scheduler.finish_request(request, status)
        request.metrics.finished_time = time.time()
        stats.finished_requests.append(finished_stats(request))
        self._change(request)

    def _forget_if_done(self, request_id: str) -> None:
        children = self._requests.get(request_id)
        if children is not None and all(r.is_finished for r in children):
            del self._requests[request_id]

    # ---- state ---------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler and the pool now; with two KV cache groups the block counts are the
        full-attention group's (it holds every token), plus the sliding group's total and free."""
        kv = self.block_manager
        hybrid = kv if isinstance(kv, HybridBlockManager) else None
        bm = kv.full if isinstance(kv, HybridBlockManager) else kv
        running = self.scheduler.running
        return SchedulerStats(
            num_running_reqs=len(running), num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage, num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks, num_blocks_cached=len(bm.cached),
            num_tokens_held=sum(r.num_computed_tokens for r in running),
            num_slots_reserved=sum(len(r.block_ids) for r in running) * bm.block_size,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_blocks_touched=bm.num_blocks_touched,
            num_sliding_blocks_total=hybrid.sliding.num_blocks if hybrid is not None else 0,
            num_sliding_blocks_free=hybrid.sliding.num_free_blocks if hybrid is not None else 0,
        )

    def check_integrity(self) -> None:
        """Asserts the block pool's invariants (tests and idle engines call it)."""
        bm = self.block_manager
        bm.check()
        if not self.has_unfinished_requests():
            for group in bm.groups if isinstance(bm, HybridBlockManager) else (bm,):
                assert group.num_free_blocks == group.num_usable_blocks, "leaked KV blocks"

    def shutdown(self) -> None:
        """Stops what runs beside the core (parallel workers); idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
