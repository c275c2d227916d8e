"""Continuous batching under a token budget, with no prefill or decode phase.

Each request only has `num_computed_tokens` and `num_tokens`; a step gives each running
request, then each waiting one in arrival order, as many of its uncomputed tokens as the
budget allows, so long prompts are chunked and prefills share steps with decodes. When the
pool runs dry the newest running request is preempted (its blocks freed, to be recomputed).
A running request's drafted tokens (`spec_token_ids`) are scheduled with it as extra tokens
when the budget has room; drafts that do not fit are dropped, never the real tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagoda.block_manager import BlockManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run this step: requests with their token counts, in running order."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[tuple[str, int], Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.key] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(self._num_new_tokens(request, budget), budget)
            if num_tokens <= 0:
                continue
            if not self._allocate_or_preempt(request, num_tokens, out):
                break
            out.add(request, num_tokens)
            budget -= num_tokens
        return budget

    @staticmethod
    def _num_new_tokens(request: Request, budget: int) -> int:
        """Uncomputed tokens plus the drafts that fit the budget (the rest are dropped)."""
        num_new = request.num_tokens - request.num_computed_tokens
        if request.spec_token_ids:
            room = max(budget - num_new, 0)
            del request.spec_token_ids[room:]
            num_new += len(request.spec_token_ids)
        return num_new

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.preempt(request)
        out.preempted.append(request)

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and queues it first, to be recomputed."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed = bm.get_computed_blocks(request)
            num_hit = len(computed) * bm.block_size
            num_tokens = min(request.num_tokens - num_hit, budget)
            if not bm.allocate_slots(request, num_tokens, computed):
                break
            self.waiting.popleft()
            self._admit(request, num_hit)
            out.add(request, num_tokens)
            budget -= num_tokens

    def _admit(self, request: Request, num_hit: int) -> None:
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
            request.metrics.num_cached_tokens = num_hit
            request.metrics.first_scheduled_time = time.time()
            if self.block_manager.enable_prefix_caching:
                self.block_manager.record_prefix_query(request.num_tokens, num_hit)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def update_from_output(self, out: SchedulerOutput) -> list[Request]:
        """Advances computed counts; returns the requests that now need a sampled token."""
        ready = []
        for request, num_tokens in zip(out.requests, out.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_tokens:
                ready.append(request)
        return ready

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Removes a request (finished, aborted or failed) and frees its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished and request in self.waiting:
            self.waiting.remove(request)
        if status is RequestStatus.FINISHED_ERROR:
            # NOTE: blocks computed before the failed step hold good KV (a shared system prompt).
            self.block_manager.uncache(request, request.num_computed_tokens // self.block_manager.block_size)
        self.block_manager.free(request)
        request.status = status
        self.requests.pop(request.key, None)
