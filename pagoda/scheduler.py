"""Continuous batching under a token budget, with no prefill or decode phase.

Each request only has `num_computed_tokens` and `num_tokens`; a step gives each running
request, then each waiting one in the `RequestQueue`'s order (arrival, with many-prompt
requests taking turns with others; priority first under the "priority" policy), as many of
its uncomputed tokens as the budget allows, so long prompts are chunked and prefills share
steps with decodes. When the pool runs dry the newest running request (under "priority":
the worst, then newest) is preempted (its blocks freed, to be recomputed). When the next
waiting request's group holds no seat while another holds several, it gets a seat (taken
back from the group holding the most if all `max_num_seqs` are taken), a share of the
step's tokens and a short step (at most 1.25x what its own tokens would take alone, by the
fitted step cost), so one client's 1,000 prompts cannot hold every seat nor every prefill,
nor make another's first token wait for a step full of theirs.
When the budget cannot take every running request's tokens (a long prefill, or more decodes
than the budget), the least recently served go first, so every request advances in turn.
Under `step_time_target_ms` the budget is what the last steps' times say fits the target
(step_cost.py). With `max_loras`, a waiting request whose adapter would make the running
requests use more distinct adapters than that waits in its place while those behind it go on;
so does a long prompt (above `prefill_chunk_tokens`) while `max_long_partial_prefills` long
prompts prefill, under vLLM's `max_num_partial_prefills` > 1 (which also caps the prompts
prefilling at once and each one's chunk a step; a short prompt that may start beside a long
prefill gets a newcomer's short step).
A running request's drafted tokens (the proposer's, given to `schedule`) are scheduled with
it as extra tokens when the budget has room, and recorded in the output
(`SchedulerOutput.spec_token_ids`); drafts that do not fit are dropped, never the real tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from pagoda.block_manager import BlockManager
from pagoda.config import SchedulerConfig
from pagoda.kv_cache_manager import HybridBlockManager
from pagoda.request import Request, RequestStatus
from pagoda.request_queue import RequestQueue
from pagoda.step_cost import StepCost

# NOTE: a newcomer's first step among another group's many prompts costs at most this many
# times a step of its own tokens alone (`Scheduler._newcomer_total`). The line is fitted over
# full steps, where a decode row's output costs less a token than in a short step: at 1.5 a
# probe's first token took 1.35-1.73x its idle time on a Zen 4, at 1.25 1.07-1.08x
# (`pagoda bench fairness`, docs/benchmarks.md).
NEWCOMER_STEP_FACTOR = 1.25


@dataclass
class SchedulerOutput:
    """What to run this step: requests with their token counts, in running order."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    seat_preemptions: int = 0  # of `preempted`, those that gave a seat to another group
    # NOTE: the drafted tokens scheduled with a request (counted in its scheduled tokens).
    spec_token_ids: dict[Request, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, request: Request, num_tokens: int, spec_token_ids: list[int] | None = None) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        if spec_token_ids:
            self.spec_token_ids[request] = spec_token_ids

    def drafts(self, request: Request) -> list[int]:
        """The drafted tokens scheduled with `request` (none: [])."""
        return self.spec_token_ids.get(request, [])

    def alone(self, request: Request, num_tokens: int) -> SchedulerOutput:
        """A step of `request` alone, as scheduled here (with its drafts)."""
        out = SchedulerOutput()
        out.add(request, num_tokens, self.spec_token_ids.get(request))
        return out

    def unschedule(self, request: Request) -> int:
        """Takes `request` out of this step; returns the tokens it had (0 if not in it)."""
        for i, scheduled in enumerate(self.requests):
            if scheduled is request:
                del self.requests[i]
                self.spec_token_ids.pop(request, None)
                return self.num_scheduled_tokens.pop(i)
        return 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | HybridBlockManager,
                 max_loras: int | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_loras = max_loras  # LoRAConfig.max_loras: distinct adapters running at once
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_cost = StepCost()
        self._num_steps = 0
        # NOTE: the step each running (or preempted) request was last scheduled in.
        self._last_served: dict[Request, int] = {}
        self._shortened_for: Request | None = None  # the last newcomer given a short step

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[Request, list[int]] | None = None) -> SchedulerOutput:
        """This step's requests; `drafts` are the proposer's tokens for running requests,
        scheduled with them as far as the budget has room."""
        out = SchedulerOutput()
        self._num_steps += 1
        total = self.token_budget()
        reserve, total = self._make_room(out, total)
        budget = self._schedule_running(out, total - reserve, drafts or {})
        if len(out.preempted) == out.seat_preemptions:  # NOTE: no room was short
            self._schedule_waiting(out, budget + reserve)
        return out

    def token_budget(self) -> int:
        """This step's token budget: the configured one, or less under a step time target."""
        target = self.config.step_time_target_ms
        if target is None:
            return self.config.step_tokens
        return self.step_cost.budget(target / 1000, self.config.step_tokens)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A finished step's scheduled tokens and time (the step time target's evidence)."""
        self.step_cost.record(num_tokens, seconds)

    def _make_room(self, out: SchedulerOutput, total: int) -> tuple[int, int]:
        """Room for a waiting request whose group holds no seat while another group holds
        several (one client's many prompts): a seat, taken back from the group holding the
        most when all are taken (its newest waits first in its group), up to half the token
        budget (decodes beyond the other half wait their turn), and a step no longer than
        `_newcomer_total` says. Returns (the tokens reserved, the step's token budget)."""
        if not self.waiting or not self.running:
            return 0, total
        held = Counter(r.group for r in self.running)
        head = self.waiting.peek(held)
        group, seats = held.most_common(1)[0]
        if held[head.group]:
            return 0, total
        if seats < 2:
            return self._room_beside_long_prefill(head, total)
        if len(self.running) >= self.config.admission_limit:
            victim = next((r for r in reversed(self.running)
                           if r.group == group and not self._better(r, head)), None)
            if victim is None:
                return 0, total
            self._release(victim)
            self.waiting.return_to_group(victim)
            out.preempted.append(victim)
            out.seat_preemptions += 1
        return self._newcomer_step(head, total)

    def _room_beside_long_prefill(self, head: Request, total: int) -> tuple[int, int]:
        """Under `max_num_partial_prefills` > 1, a short waiting prompt that may start while a
        long one prefills: as a newcomer among many prompts, its tokens reserved and a short
        step (the long chunk waits that step), where a seat is free. Returns (the tokens
        reserved, the step's token budget)."""
        if not self.config.partial_prefills or self._is_long(head):
            return 0, total
        prefills = self._partial_prefills()
        if (not prefills[True] or len(self.running) >= self.config.admission_limit
                or self._over_partial_prefills(head, prefills) is not False):
            return 0, total
        return self._newcomer_step(head, total)

    def _newcomer_step(self, head: Request, total: int) -> tuple[int, int]:
        """The tokens reserved for `head` (up to half the budget) and the step's budget."""
        reserve = min(head.num_tokens, total // 2)
        return reserve, self._newcomer_total(head, reserve, total)

    def _newcomer_total(self, head: Request, tokens: int, total: int) -> int:
        """The budget of the step that seats `head` (`tokens` of its prompt) among another
        group's many prompts: what the fitted step cost says ends within
        `NEWCOMER_STEP_FACTOR` times a step of those tokens alone, so that its first token
        comes near its time on an idle engine, not after a step full of the other group's
        decodes and prefills (32x on a Zen 4: docs/benchmarks.md, `bench fairness`). Once a
        request (a newcomer the pool cannot take yet is not shortened twice), and only while
        its blocks are free; the next steps take the whole budget again."""
        line = self.step_cost.fit()
        if line is None or head is self._shortened_for or not self._fits(0, tokens, 0.0):
            return total
        self._shortened_for = head
        overhead, per_token = line
        alone = overhead + per_token * tokens
        fits = int((NEWCOMER_STEP_FACTOR * alone - overhead) / per_token + 1e-6)
        return min(total, max(tokens, fits))

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          drafts: dict[Request, list[int]]) -> int:
        for request in self._in_turn(budget):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._capped(request.num_tokens - request.num_computed_tokens)
            # NOTE: the drafts that fit the budget go with it; the rest are dropped.
            spec = drafts.get(request, [])[:max(budget - num_new, 0)]
            num_tokens = min(num_new + len(spec), budget)
            if num_tokens <= 0:
                continue
            refund = self._allocate_or_preempt(request, num_tokens, out)
            if refund is None:
                break
            out.add(request, num_tokens, spec)
            self._last_served[request] = self._num_steps
            budget += refund - num_tokens
        return budget

    def _capped(self, num_new: int) -> int:
        """A request's new tokens this step, at most `prefill_chunk_tokens` when set."""
        cap = self.config.prefill_chunk_tokens
        return min(num_new, cap) if cap > 0 else num_new

    def _is_long(self, request: Request) -> bool:
        """Whether a prompt is long for `max_long_partial_prefills`."""
        return request.num_prompt_tokens > self.config.prefill_chunk_tokens

    def _partial_prefills(self) -> Counter[bool]:
        """The running requests still computing their prompt, by whether it is long."""
        return Counter(self._is_long(r) for r in self.running if r.num_computed_tokens + 1 < r.num_tokens)

    def _over_partial_prefills(self, request: Request, prefills: Counter[bool]) -> bool | None:
        """Under `max_num_partial_prefills` > 1: None when no prompt may start (that many
        prefill already), True when this long one must wait (as many long ones prefill as
        `max_long_partial_prefills`; shorter ones behind it go first), else False."""
        config = self.config
        if not config.partial_prefills:
            return False
        if prefills.total() >= config.max_num_partial_prefills:
            return None
        return self._is_long(request) and prefills[True] >= config.max_long_partial_prefills

    def _in_turn(self, budget: int) -> list[Request]:
        """The running requests in the order this step serves them: as they run when the
        budget takes all their tokens, else the least recently served first (in running order
        among equals), so a long prefill or a crowd of decodes leaves none behind for long."""
        if sum(r.num_tokens - r.num_computed_tokens for r in self.running) <= budget:
            return list(self.running)
        return sorted(self.running, key=lambda r: self._last_served.get(r, 0))

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> int | None:
        """Allocates `request`'s slots, preempting until they fit; returns the tokens freed by
        victims scheduled earlier in this step, or None if `request` itself was the victim."""
        refund = 0
        while not self.block_manager.allocate_slots(request, num_tokens):
            victim = self._victim()
            # NOTE: under "priority" the victim may have been scheduled earlier in this step.
            refund += out.unschedule(victim)
            self._preempt(victim, out)
            if victim is request:
                return None
        return refund

    def _better(self, request: Request, other: Request) -> bool:
        """Whether `request` is served before `other` by priority alone."""
        return self.config.scheduling_policy == "priority" and request.priority < other.priority

    def _victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(reversed(self.running), key=lambda r: r.priority)  # worst, then newest
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.preempt(request)
        out.preempted.append(request)

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and queues it first, to be recomputed."""
        self._release(request)
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        held = Counter(r.group for r in self.running)
        # NOTE: the adapters running, counted only under a `max_loras`
        adapters = ({r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                    if self.max_loras is not None else set())
        prefills = self._partial_prefills() if self.config.partial_prefills else Counter[bool]()
        skipped: list[tuple[Request, bool]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.admission_limit:
            request = self.waiting.peek(held)
            over = self._over_partial_prefills(request, prefills)
            if over is None:
                break
            if over or self._over_max_loras(request, adapters):
                skipped.append((request, self.waiting.head_is_resumed()))
                self.waiting.popleft(held)
                continue
            computed = bm.get_computed_blocks(request)
            num_hit = len(computed) * bm.block_size
            num_tokens = min(self._capped(request.num_tokens - num_hit), budget)
            if not self._admissible(request, num_hit, num_tokens):
                break
            if not bm.allocate_slots(request, num_tokens, computed):
                break
            self.waiting.popleft(held)
            held[request.group] += 1
            prefills[self._is_long(request)] += 1
            self._admit(request, num_hit)
            out.add(request, num_tokens)
            self._last_served[request] = self._num_steps
            budget -= num_tokens
            if request.lora_request is not None:
                adapters.add(request.lora_request.lora_int_id)
        for request, resumed in reversed(skipped):
            self.waiting.put_back(request, resumed)

    def _over_max_loras(self, request: Request, adapters: set[int]) -> bool:
        """Whether admitting `request` would make the running requests use more distinct
        adapters than `max_loras` (vLLM's check: it waits, the requests behind it go on)."""
        return (self.max_loras is not None and request.lora_request is not None
                and request.lora_request.lora_int_id not in adapters and len(adapters) >= self.max_loras)

    def _admissible(self, request: Request, num_hit: int, num_tokens: int) -> bool:
        """vLLM's admission gates beyond the chunk's own blocks, each off by default: the whole
        sequence must fit (`scheduler_reserve_full_isl`), and while others run a `watermark`
        of the blocks stays free."""
        reserve, watermark = self.config.scheduler_reserve_full_isl, self.config.watermark if self.running else 0.0
        if not reserve and watermark <= 0:
            return True
        return self._fits(num_hit, request.num_tokens - num_hit if reserve else num_tokens, watermark)

    def _fits(self, num_hit: int, num_tokens: int, watermark: float) -> bool:
        """Whether `num_tokens` after `num_hit` cached ones fit in the full-attention group's
        free blocks with vLLM's `watermark` fraction of its blocks left over (the scheduler's
        admission gate; `allocate_slots` still decides the chunk exactly)."""
        bm = self.block_manager
        group = bm.full if isinstance(bm, HybridBlockManager) else bm
        needed = group.blocks_needed(num_hit + num_tokens) - num_hit // group.block_size
        return group.num_free_blocks - needed >= int(watermark * group.num_usable_blocks)

    def _admit(self, request: Request, num_hit: int) -> None:
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
            request.metrics.num_cached_tokens = num_hit
            request.metrics.first_scheduled_time = time.time()
            if self.block_manager.takes_prefix_hits(request):
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
        elif not request.is_finished:
            self.waiting.discard(request)
        if status is RequestStatus.FINISHED_ERROR:
            # NOTE: blocks computed before the failed step hold good KV (a shared system prompt).
            self.block_manager.uncache(request, request.num_computed_tokens // self.block_manager.block_size)
        self.block_manager.free(request)
        self._last_served.pop(request, None)
        if request is self._shortened_for:
            self._shortened_for = None
        request.status = status
