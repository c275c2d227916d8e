"""Property-based tests of the scheduler and the block pool (hypothesis).

Random sequences of adds (prompts from a tiny vocabulary, so prefixes are shared and the
prefix cache hits), steps, aborts and random stops run against a small pool, so preemption is
frequent. The model is simulated: computing position p of a request writes, into that
position's slot, a fingerprint of the request's tokens up to p (what real K/V depends on).
After every step the invariants are checked, the strongest being that every computed
position of every running request reads its own fingerprint: a prefix hit, an eviction or a
preemption never serves another prefix's KV. At the end every block is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from pagoda.block_manager import BlockManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import Scheduler

MAX_MODEL_LEN = 48

prompts = st.lists(st.integers(1, 3), min_size=1, max_size=30)
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts, st.integers(1, 40), st.integers(0, 3), st.integers(-1, 1)),
    st.tuples(st.just("step"), st.integers(0, 2**16)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
), min_size=5, max_size=80)


@dataclass
class Sim:
    scheduler: Scheduler
    bm: BlockManager
    slots: dict[int, tuple[int, ...]] = field(default_factory=dict)
    live: list[Request] = field(default_factory=list)
    count: int = 0

    def add(self, prompt: list[int], max_tokens: int, group: int = 0, priority: int = 0) -> None:
        self.count += 1
        # NOTE: group 0 is the request's own; 1-3 are many-prompt requests' shared groups.
        request = Request(f"r{self.count}", prompt, SamplingParams(max_tokens=max_tokens),
                          set(), max_model_len=MAX_MODEL_LEN, priority=priority,
                          group=f"g{group}" if group else None)
        self.scheduler.add_request(request)
        self.live.append(request)

    def slot(self, request: Request, pos: int) -> int:
        bs = self.bm.block_size
        return request.block_ids[pos // bs] * bs + pos % bs

    def step(self, seed: int) -> None:
        out = self.scheduler.schedule()
        # NOTE: a made-up step time (2 ms + 1 ms a token, jittered) for the step time target.
        self.scheduler.record_step(out.total_num_scheduled_tokens,
                                   0.002 + 0.001 * out.total_num_scheduled_tokens * (1 + seed % 5 / 10))
        config = self.scheduler.config
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(self.scheduler.running) <= config.max_num_seqs
        assert not set(out.preempted) & set(out.requests)
        for request, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            assert request.status is RequestStatus.RUNNING and n > 0
            assert request.num_computed_tokens + n <= request.num_tokens
            assert len(request.block_ids) * self.bm.block_size >= request.num_computed_tokens + n
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + n):
                self.slots[self.slot(request, pos)] = tuple(request.all_token_ids[:pos + 1])
        for request, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            for pos in range(request.num_computed_tokens + n):
                assert self.slots.get(self.slot(request, pos)) == tuple(
                    request.all_token_ids[:pos + 1]), f"{request.request_id} reads wrong KV at {pos}"
        for i, request in enumerate(self.scheduler.update_from_output(out)):
            mix = (seed * 2654435761 + i * 40503 + request.num_tokens * 97) % 2**32
            request.append_token(1 + mix % 3)
            stop = mix % 37 == 0
            if request.check_stop() is not None or stop:
                self.finish(request, RequestStatus.FINISHED_STOPPED)

    def abort(self, index: int) -> None:
        if self.live:
            self.finish(self.live[index % len(self.live)], RequestStatus.FINISHED_ABORTED)

    def finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.live.remove(request)

    def check(self) -> None:
        self.bm.check()
        holders: dict[int, int] = {}
        for request in self.live:
            assert len(set(request.block_ids)) == len(request.block_ids)
            if request.status is not RequestStatus.RUNNING:
                assert request.block_ids == [] and request.num_computed_tokens == 0
            assert request.num_computed_tokens <= request.num_tokens <= MAX_MODEL_LEN
            for block_id in request.block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id}"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, extra_blocks=st.integers(0, 12), block_size=st.sampled_from([2, 4, 8]),
       caching=st.booleans(), max_num_seqs=st.integers(1, 6),
       budget=st.integers(MAX_MODEL_LEN // 2, 64), policy=st.sampled_from(["fcfs", "priority"]),
       step_ms=st.sampled_from([None, 20.0, 40.0]), partial=st.sampled_from([1, 1, 2, 3]))
def test_random_workloads_keep_every_invariant(ops, extra_blocks, block_size, caching,
                                               max_num_seqs, budget, policy, step_ms, partial):
    # NOTE: one max_model_len sequence must fit (the engine refuses a smaller pool at start)
    num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
    bm = BlockManager(num_blocks, block_size, caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=MAX_MODEL_LEN, scheduling_policy=policy,
                             step_time_target_ms=step_ms, max_num_partial_prefills=partial,
                             long_prefill_token_threshold=8 if partial > 1 else 0)
    sim = Sim(Scheduler(config, bm), bm)
    for op in ops:
        if op[0] == "add":
            sim.add(*op[1:])
        elif op[0] == "step":
            sim.step(op[1])
        else:
            sim.abort(op[1])
        sim.check()
    for i in range(10_000):
        if not sim.live:
            break
        sim.step(i * 7919)
        sim.check()
    assert not sim.live, "requests never finished"
    assert bm.num_free_blocks == bm.num_blocks
    # NOTE: steer the search towards the hard cases: preemption and prefix hits.
    target(float(sim.scheduler.num_preemptions), label="preemptions")
    target(float(bm.prefix_cache_hits), label="prefix hits")


# ---- fairness and priority -------------------------------------------------------------------
def _scheduler(max_num_seqs: int = 8, policy: str = "fcfs", num_blocks: int = 256, budget: int = 64,
               step_ms: float | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=MAX_MODEL_LEN, scheduling_policy=policy,
                             step_time_target_ms=step_ms)
    return Scheduler(config, BlockManager(num_blocks, 4, False))


def _request(name: str, group: str | None = None, priority: int = 0, max_tokens: int = 30) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), set(),
                   max_model_len=MAX_MODEL_LEN, priority=priority, group=group)


def _step(scheduler: Scheduler) -> list[Request]:
    out = scheduler.schedule()
    for request in scheduler.update_from_output(out):
        request.append_token(1)
    return out.requests


def test_a_request_behind_a_many_prompt_batch_runs_at_once():
    """Issue 23: one request of 1,000 prompts pushed other clients' latency to 26 s (first
    come, first served). The prompts of one request are one group; a later request of
    another group gets the next seat, and a seat is taken back for it when all are full."""
    scheduler = _scheduler(max_num_seqs=8)
    for i in range(1000):
        scheduler.add_request(_request(f"batch-{i}", group="batch"))
    for _ in range(3):
        _step(scheduler)
    assert len(scheduler.running) == 8 and {r.group for r in scheduler.running} == {"batch"}
    probe = _request("probe")
    scheduler.add_request(probe)
    assert probe in _step(scheduler), "the probe waited behind the batch"
    assert len(scheduler.running) == 8 and scheduler.num_preemptions == 1
    for _ in range(3):
        _step(scheduler)
    assert probe in scheduler.running and scheduler.num_preemptions == 1  # no thrashing


def test_single_requests_keep_arrival_order():
    scheduler = _scheduler(max_num_seqs=2)
    requests = [_request(f"r{i}", max_tokens=1) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    order = []
    while scheduler.has_unfinished_requests():
        for request in scheduler.update_from_output(scheduler.schedule()):
            request.append_token(1)
            order.append(request.request_id)
            scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
    assert order == [f"r{i}" for i in range(6)]


def test_priority_policy_serves_lower_values_first():
    scheduler = _scheduler(max_num_seqs=2, policy="priority", num_blocks=1)
    low, high, urgent = _request("low", priority=5), _request("high", priority=1), _request("urgent", priority=-3)
    for request in (low, high):
        scheduler.add_request(request)
    assert _step(scheduler) == [high]  # one block: only one fits, the better one
    scheduler.add_request(urgent)
    scheduler.finish_request(high, RequestStatus.FINISHED_ABORTED)
    assert _step(scheduler) == [urgent]
    fcfs = _scheduler(max_num_seqs=2, num_blocks=1)
    for request in (_request("a", priority=5), _request("b", priority=1)):
        fcfs.add_request(request)
    assert [r.request_id for r in _step(fcfs)] == ["a"]  # fcfs ignores priority


def test_priority_preemption_takes_the_worst_running_request():
    scheduler = _scheduler(max_num_seqs=4, policy="priority", num_blocks=4)
    good, bad = _request("good", priority=0, max_tokens=40), _request("bad", priority=9, max_tokens=40)
    scheduler.add_request(good)
    _step(scheduler)
    scheduler.add_request(bad)
    preempted: list[Request] = []
    for _ in range(40):
        out = scheduler.schedule()
        preempted += out.preempted
        for request in scheduler.update_from_output(out):
            request.append_token(1)
        if preempted:
            break
    assert preempted and preempted[0] is bad


def _decoding(scheduler: Scheduler, n: int, group: str | None = None) -> list[Request]:
    """`n` requests, stepped until every one is running and past its prompt."""
    requests = [_request(f"r{i}", group=group, max_tokens=40) for i in range(n)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(40):
        _step(scheduler)
        if all(r.output_token_ids for r in requests):
            return requests
    raise AssertionError("the requests never all decoded")


def test_running_requests_take_turns_when_the_budget_is_short():
    """More decodes than the budget: before, the first ones ran every step and the rest never
    (until the first finished); now the least recently served go first."""
    scheduler = _scheduler(max_num_seqs=8, budget=64)
    requests = _decoding(scheduler, 8)
    # NOTE: as when a step time target cuts the budget after the seats were taken.
    scheduler.config = replace(scheduler.config, max_num_batched_tokens=4)
    served = [r for _ in range(4) for r in _step(scheduler)]
    assert sorted(served.count(r) for r in requests) == [2] * 8


def test_a_newcomer_gets_tokens_when_decodes_fill_the_budget():
    """A request of another group arriving while a batch's decodes need the whole budget is
    prefilled in the next step (it used to wait for the batch's decodes to leave room)."""
    scheduler = _scheduler(max_num_seqs=16, budget=8)
    _decoding(scheduler, 8, group="batch")
    probe = _request("probe")
    scheduler.add_request(probe)
    assert probe in _step(scheduler) and probe.num_computed_tokens == 3


def _batch_running(scheduler: Scheduler, line: bool) -> None:
    """A many-prompt group's 40 prompts, 24 of them decoding (every seat taken; a step with a
    newcomer took 26 tokens of the budget of 32); with `line`, steps of 10 ms + 0.5 ms a
    token recorded."""
    for i in range(40):
        scheduler.add_request(_request(f"b{i}", group="batch", max_tokens=40))
    for _ in range(8):
        _step(scheduler)
    assert len(scheduler.running) == 24
    if line:
        for n in (8, 16, 24, 32):
            scheduler.record_step(n, 0.010 + 0.0005 * n)


def test_a_newcomers_first_step_is_short_behind_a_many_prompt_batch():
    """Issue 23: behind a batch whose decodes fill every step, a newcomer of another group
    waited a whole step of theirs for its first token (32x its idle time on a Zen 4). Its
    first step now costs at most 1.25x a step of its own 3 tokens by the fitted line:
    (1.25 x 11.5 ms - 10 ms) / 0.5 ms = 8 tokens, its 3 among them; then full steps."""
    scheduler = _scheduler(max_num_seqs=24, budget=32)
    _batch_running(scheduler, line=True)
    probe = _request("probe")
    scheduler.add_request(probe)
    out = scheduler.schedule()
    assert probe in out.requests and out.total_num_scheduled_tokens == 8
    for request in scheduler.update_from_output(out):
        request.append_token(1)
    assert scheduler.schedule().total_num_scheduled_tokens == 24


def test_a_newcomers_step_is_full_without_a_line_or_a_many_prompt_group():
    """No fitted line yet: the newcomer's step as before (the budget's 32 tokens minus the
    6 decodes left for the next step); every group with one seat (plain serving, one request
    a client): no short step, whatever the line says."""
    scheduler = _scheduler(max_num_seqs=24, budget=32)
    _batch_running(scheduler, line=False)
    scheduler.add_request(_request("probe"))
    assert scheduler.schedule().total_num_scheduled_tokens == 26
    plain = _scheduler(max_num_seqs=24, budget=32)
    for i in range(40):
        plain.add_request(_request(f"r{i}", max_tokens=40))
    for _ in range(8):
        _step(plain)
    for n in (8, 16, 24, 32):
        plain.record_step(n, 0.010 + 0.0005 * n)
    plain.add_request(_request("late"))
    assert plain.schedule().total_num_scheduled_tokens == 24


def test_a_newcomer_that_cannot_start_shortens_one_step_at_most():
    """A newcomer whose blocks are not free shortens no step; one that another gate keeps out
    (here a watermark of 99% of the pool) shortens its first try only: a newcomer the
    scheduler keeps refusing never starves the batch."""
    scheduler = _scheduler(max_num_seqs=24, budget=32)
    _batch_running(scheduler, line=True)
    scheduler._fits = lambda *args: False  # type: ignore[method-assign]
    scheduler.add_request(_request("no-room"))
    assert scheduler.schedule().total_num_scheduled_tokens > 8
    gated = _scheduler(max_num_seqs=24, budget=32)
    _batch_running(gated, line=True)
    gated.config = replace(gated.config, watermark=0.99)
    late = _request("late")
    gated.add_request(late)
    # NOTE: 23 running: one gave its seat to the newcomer, who then did not pass the gate.
    assert [gated.schedule().total_num_scheduled_tokens for _ in range(3)] == [5, 23, 23]
    assert late.status is RequestStatus.WAITING


def test_long_prefill_token_threshold_caps_a_prompts_chunk_per_step():
    """vLLM's --long-prefill-token-threshold: a 40-token prompt computes at most 8 tokens a
    step, running or newly admitted, and the rest of the budget goes to a short newcomer."""
    scheduler = _scheduler(budget=64)
    scheduler.config = replace(scheduler.config, long_prefill_token_threshold=8)
    long = Request("long", list(range(1, 41)), SamplingParams(max_tokens=4), set(), max_model_len=MAX_MODEL_LEN)
    scheduler.add_request(long)
    out = scheduler.schedule()
    assert dict(zip(out.requests, out.num_scheduled_tokens, strict=True)) == {long: 8}
    scheduler.update_from_output(out)
    short = _request("short")
    scheduler.add_request(short)
    out = scheduler.schedule()
    assert dict(zip(out.requests, out.num_scheduled_tokens, strict=True)) == {long: 8, short: 3}
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def _prompt(name: str, length: int) -> Request:
    return Request(name, list(range(1, length + 1)), SamplingParams(max_tokens=4), set(),
                   max_model_len=MAX_MODEL_LEN)


def test_partial_prefills_let_short_prompts_pass_a_long_ones_queue():
    """vLLM's --max-num-partial-prefills 2 --max-long-partial-prefills 1 (a prompt above 8
    tokens is long): while one long prompt prefills, 8 tokens a step, a second long one waits
    in its place and the short ones behind it start, one at a time (two prefills at once);
    the second long one starts when the first is done. By default (1) all start at once."""
    def scheduler(partial: int) -> Scheduler:
        s = _scheduler(budget=64)
        s.config = replace(s.config, long_prefill_token_threshold=8, max_num_partial_prefills=partial)
        return s

    limited = scheduler(2)
    first, second, short, shorter = _prompt("long-1", 40), _prompt("long-2", 40), _prompt("s", 3), _prompt("t", 2)
    for request in (first, second, short, shorter):
        limited.add_request(request)
    assert _step(limited) == [first, short]
    assert [r.request_id for r in limited.waiting] == ["long-2", "t"]
    assert _step(limited) == [first, short, shorter]
    for _ in range(3):
        _step(limited)
    assert first.num_computed_tokens == 40 and second.status is RequestStatus.WAITING
    assert second in _step(limited)
    plain = scheduler(1)
    requests = [_prompt("long-1", 40), _prompt("long-2", 40), _prompt("s", 3), _prompt("t", 2)]
    for request in requests:
        plain.add_request(request)
    assert _step(plain) == requests


def test_partial_prefills_give_a_short_prompt_a_short_first_step_beside_a_long_one():
    """Under partial prefills, a short prompt arriving while a long one prefills (12 tokens a
    step) starts in a short step, as a newcomer among many prompts does: by the fitted line
    (10 ms + 0.5 ms a token) at most 1.25x its own 3 tokens, 8 tokens, the long chunk taking
    the other 5; then the long chunk is whole again. (Beside it, it took 3 of a 15-token step.)"""
    scheduler = _scheduler(budget=16)
    scheduler.config = replace(scheduler.config, long_prefill_token_threshold=12, max_num_partial_prefills=2)
    long = _prompt("long", 40)
    scheduler.add_request(long)
    _step(scheduler)
    for n in (4, 8, 12, 16):
        scheduler.record_step(n, 0.010 + 0.0005 * n)
    short = _prompt("short", 3)
    scheduler.add_request(short)
    out = scheduler.schedule()
    assert dict(zip(out.requests, out.num_scheduled_tokens, strict=True)) == {long: 5, short: 3}
    for request in scheduler.update_from_output(out):
        request.append_token(1)
    assert scheduler.schedule().num_scheduled_tokens == [12, 1]


def test_max_num_scheduled_tokens_caps_a_step_below_the_budget():
    """vLLM's --max-num-scheduled-tokens: 8 tokens a step out of a 64-token budget."""
    scheduler = _scheduler(budget=64)
    scheduler.config = replace(scheduler.config, max_num_scheduled_tokens=8)
    for i in range(4):
        scheduler.add_request(_request(f"r{i}"))
    out = scheduler.schedule()
    assert scheduler.token_budget() == 8 and out.total_num_scheduled_tokens == 8
    assert out.num_scheduled_tokens == [3, 3, 2]  # the third prompt chunked
    assert replace(scheduler.config, max_num_scheduled_tokens=100).step_tokens == 64  # never above the budget
    with pytest.raises(ValueError, match="max_num_scheduled_tokens"):
        SchedulerConfig(max_num_scheduled_tokens=0)


def test_max_num_active_seqs_admits_fewer_than_max_num_seqs():
    """vLLM's --max-num-active-seqs: 2 of 4 requests run while max_num_seqs is 8; the others
    start as the first finish."""
    scheduler = _scheduler(max_num_seqs=8)
    scheduler.config = replace(scheduler.config, max_num_active_seqs=2)
    requests = [_request(f"r{i}", max_tokens=1) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    assert _step(scheduler) == requests[:2] and len(scheduler.running) == 2
    for request in requests[:2]:
        scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
    assert _step(scheduler) == requests[2:]
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_active_seqs=9)


def test_a_watermark_keeps_kv_blocks_free_from_newcomers():
    """vLLM's --watermark 0.5 on a 10-block pool: newcomers stop where admitting one would
    leave fewer than 5 blocks free (the first, with nothing running, is always admitted)."""
    def admitted(watermark: float) -> int:
        scheduler = _scheduler(max_num_seqs=8, num_blocks=10)
        scheduler.config = replace(scheduler.config, watermark=watermark)
        for i in range(8):
            scheduler.add_request(_request(f"r{i}"))  # 3 tokens: one 4-token block each
        return len(scheduler.schedule().requests)

    assert admitted(0.0) == 8 and admitted(0.5) == 5 and admitted(0.95) == 1
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark=1.0)


def test_reserve_full_isl_admits_only_a_whole_sequence_that_fits():
    """vLLM's --scheduler-reserve-full-isl: a 40-token prompt (10 blocks of 4) on a 12-block pool
    where two decoding requests hold 6 blocks waits, though its first 14-token chunk would fit;
    without the flag it starts."""
    def starts(reserve: bool) -> bool:
        scheduler = _scheduler(max_num_seqs=8, num_blocks=12, budget=16)
        scheduler.config = replace(scheduler.config, scheduler_reserve_full_isl=reserve)
        for i in range(2):
            scheduler.add_request(Request(f"held{i}", list(range(1, 9)), SamplingParams(max_tokens=4), set(),
                                          max_model_len=MAX_MODEL_LEN))
        _step(scheduler)  # 8 prompt tokens each: 2 blocks each
        long = Request("long", list(range(1, 41)), SamplingParams(max_tokens=4), set(), max_model_len=MAX_MODEL_LEN)
        scheduler.add_request(long)
        return long in _step(scheduler)

    assert starts(False) and not starts(True)


def test_a_step_time_target_cuts_the_budget_to_the_measured_line():
    scheduler = _scheduler(max_num_seqs=100, budget=64, step_ms=30.0)
    assert scheduler.token_budget() == 64  # nothing measured yet
    for n in (8, 16, 32, 64):
        scheduler.record_step(n, 0.010 + 0.0005 * n)  # 10 ms + 0.5 ms a token
    assert scheduler.token_budget() == 40
    for i in range(100):
        scheduler.add_request(_request(f"r{i}"))
    assert scheduler.schedule().total_num_scheduled_tokens == 40


def test_max_loras_holds_back_a_third_adapter_and_lets_the_rest_by():
    """vLLM's `max_loras`: while the running requests use that many distinct adapters, a
    waiting request of another adapter waits in its place (first in line when a slot frees),
    and requests of the running adapters or of none go by it."""
    from pagoda.lora import LoRARequest

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(config, BlockManager(256, 4, False), max_loras=2)
    adapters = [LoRARequest(f"a{i}", i, f"/nowhere/a{i}") for i in (1, 2, 3)]

    def request(name: str, adapter: int | None, max_tokens: int = 30) -> Request:
        return Request(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), set(), max_model_len=MAX_MODEL_LEN,
                       lora_request=None if adapter is None else adapters[adapter - 1])

    first, second = request("one", 1, max_tokens=2), request("two", 2)
    third, again, base = request("three", 3), request("one-again", 1), request("base", None)
    for r in (first, second, third, again, base):
        scheduler.add_request(r)
    assert [r.request_id for r in _step(scheduler)] == ["one", "two", "one-again", "base"]
    assert [r.request_id for r in scheduler.waiting] == ["three"]
    assert [r.request_id for r in _step(scheduler)] == ["one", "two", "one-again", "base"]
    scheduler.finish_request(first, RequestStatus.FINISHED_LENGTH)
    scheduler.finish_request(again, RequestStatus.FINISHED_LENGTH)  # adapter 1 runs no more
    assert "three" in [r.request_id for r in _step(scheduler)]
    assert {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request} == {2, 3}
    unlimited = Scheduler(config, BlockManager(256, 4, False))
    for r in (request("x", 1), request("y", 2), request("z", 3)):
        unlimited.add_request(r)
    assert len(_step(unlimited)) == 3
