"""BlockManager on a fake workload: exact block ids, hit counts, revival and eviction order.

Block size 4 throughout. Each test drives the manager the way the scheduler does
(`admit`: look up hits, allocate after them, record the query; `step`: allocate a chunk and
mark it computed), so the numbers below can be checked by hand.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest

import pagoda.block_manager as block_manager
from pagoda.block_manager import BlockManager, hash_block
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def req(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def admit(bm: BlockManager, request: Request, budget: int | None = None) -> list[int]:
    """Schedules a waiting request (like `Scheduler._schedule_waiting`); returns its hit ids."""
    hits = bm.get_computed_blocks(request)
    num_hit = len(hits) * bm.block_size
    num_new = request.num_tokens - num_hit
    if budget is not None:
        num_new = min(num_new, budget)
    assert bm.allocate_slots(request, num_new, hits)
    bm.record_prefix_query(request.num_tokens, num_hit)
    request.num_computed_tokens += num_new
    bm.check()
    return [b.block_id for b in hits]


def step(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """Schedules and 'computes' `num_tokens` more tokens of a running request."""
    assert bm.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    bm.check()


def decode(bm: BlockManager, request: Request, token_ids: list[int]) -> None:
    """Samples `token_ids` one by one, computing each (the last one stays uncomputed)."""
    for i, token in enumerate(token_ids):
        request.append_token(token)
        if i < len(token_ids) - 1:
            step(bm, request, 1)


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


def hit_ids(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """The blocks a new request with these tokens would hit (allocating nothing)."""
    return [b.block_id for b in bm.get_computed_blocks(req("probe", token_ids))]


# ---- the hash ----------------------------------------------------------------------------
def test_hash_is_deterministic_sha256_chain():
    first = hash_block(None, [1, 2, 3, 4])
    # NOTE: a literal digest: the same on every run and in every process (no salted hash()).
    assert first.hex().startswith("5e957b4b790f828aca0343b142059503")
    assert first == hashlib.sha256(b"\x00" + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hash_block(first, [5, 6, 7, 8])
    assert second.hex().startswith("d37e5a368530f205393c521d359b4565")
    assert hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8]) != second  # the parent counts


def test_hash_extra_keys():
    base = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4], ()) == base == hash_block(None, [1, 2, 3, 4], b"")
    lora = hash_block(None, [1, 2, 3, 4], ("lora", 7))
    assert lora != base
    assert lora == hash_block(None, [1, 2, 3, 4], ("lora", 7))
    assert lora != hash_block(None, [1, 2, 3, 4], ("lora", 8))
    assert hash_block(None, [1, 2, 3, 4], b"img:abc") != base


# ---- allocation and sharing --------------------------------------------------------------
def test_fresh_allocation_caches_only_full_blocks():
    bm = BlockManager(10, BS)
    a = req("a", list(range(10)))
    assert admit(bm, a) == []
    assert a.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 7
    assert [b.block_id for b in bm.cached.values()] == [0, 1]  # block 2 holds 2 tokens
    assert bm.blocks[0].token_ids == (0, 1, 2, 3)
    assert bm.blocks[2].block_hash is None


def test_shared_prefix_hits_exact_blocks_and_counts():
    bm = BlockManager(10, BS)
    a, b = req("a", list(range(10))), req("b", list(range(8)) + [50, 51, 52])
    admit(bm, a)
    assert admit(bm, b) == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert b.num_computed_tokens == 11 and bm.blocks[0].ref_cnt == bm.blocks[1].ref_cnt == 2
    assert bm.num_free_blocks == 6
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    c = req("c", list(range(6)) + [60, 61, 62])  # diverges inside block 1: hits block 0 only
    assert admit(bm, c) == [0]
    assert c.block_ids == [0, 4, 5]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (30, 12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_whole_prompt_is_never_a_hit(k):
    bm = BlockManager(10, BS)
    prompt = list(range(k * BS))
    admit(bm, req("a", prompt))
    assert len(bm.cached) == k
    b = req("b", prompt)
    hits = admit(bm, b)
    assert hits == list(range(k - 1))  # k-1 blocks: the last token's logits must be computed
    assert b.block_ids == [*range(k - 1), k]
    assert bm.prefix_cache_hits == (k - 1) * BS


def test_chunked_prefill_caches_blocks_as_chunks_are_scheduled():
    bm = BlockManager(10, BS)
    a = req("a", list(range(14)))
    admit(bm, a, budget=3)
    assert a.block_ids == [0] and not bm.cached
    step(bm, a, 6)  # 9 tokens: blocks 0 and 1 full
    assert a.block_ids == [0, 1, 2] and sorted(b.block_id for b in bm.cached.values()) == [0, 1]
    b = req("b", list(range(14)))
    assert admit(bm, b, budget=2) == [0, 1]  # hits a's blocks while a is still prefilling
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 10


def test_decoded_blocks_are_cached_for_the_next_turn():
    bm = BlockManager(10, BS)
    a = req("a", list(range(6)))
    admit(bm, a)
    decode(bm, a, [100, 101, 102, 103, 104])  # tokens 6..10; 6..9 computed
    assert a.block_ids == [0, 1, 2] and len(bm.cached) == 2  # block 1 filled by decoding
    bm.free(a)
    follow_up = req("b", a.all_token_ids + [7, 8])  # the next turn of the conversation
    assert admit(bm, follow_up) == [0, 1]


def test_siblings_computing_the_same_block_still_chain():
    bm = BlockManager(10, BS)
    prompt = list(range(12))
    a, b = req("a#0", prompt), req("a#1", prompt)
    admit(bm, a, budget=8)
    assert admit(bm, b) == [0, 1]  # b prefills block 2 and caches it
    step(bm, a, 4)  # a computes block 2 too: same content, named like b's, not cached again
    assert a.block_ids == [0, 1, 3] and b.block_ids == [0, 1, 2]
    assert bm.blocks[3].block_hash is None and bm.blocks[3].prefix_id == bm.blocks[2].prefix_id
    decode(bm, a, [100, 101, 102, 103, 104])
    assert a.block_ids == [0, 1, 3, 4] and bm.blocks[4].block_hash is not None
    bm.free(a)
    bm.free(b)
    # a's block 4 hangs off b's cached block 2, which has the same verified content
    assert admit(bm, req("c", a.all_token_ids)) == [0, 1, 2, 4]


# ---- freeing, revival and eviction -------------------------------------------------------
def test_freed_cached_blocks_are_revived_not_recomputed():
    bm = BlockManager(10, BS)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 10 and len(bm.cached) == 2
    # the uncached tail block (2) goes to the front; cached ones to the back, tail first
    assert free_order(bm) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = req("b", list(range(8)) + [70, 71])
    assert admit(bm, b) == [0, 1]
    assert b.block_ids == [0, 1, 2] and bm.blocks[0].ref_cnt == 1
    assert free_order(bm) == [3, 4, 5, 6, 7, 8, 9]
    assert bm.prefix_cache_hits == 8


def test_lru_eviction_reuses_uncached_blocks_first_then_oldest_cached():
    bm = BlockManager(6, BS)
    a = req("a", [1, 1, 1, 1, 9])
    b = req("b", [2, 2, 2, 2, 9])
    admit(bm, a)
    admit(bm, b)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    assert free_order(bm) == [3, 1, 4, 5, 0, 2]
    c = req("c", list(range(100, 117)))  # 5 blocks: evicts a's block 0, keeps b's block 2
    admit(bm, c)
    assert c.block_ids == [3, 1, 4, 5, 0]
    assert sorted(blk.block_id for blk in bm.cached.values()) == [1, 2, 3, 4, 5]
    assert hit_ids(bm, [1, 1, 1, 1, 9]) == []
    assert hit_ids(bm, [2, 2, 2, 2, 9]) == [2]


def test_revival_refreshes_lru_position():
    bm = BlockManager(5, BS)
    a, b = req("a", [1, 1, 1, 1, 9]), req("b", [2, 2, 2, 2, 9])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    a2 = req("a2", [1, 1, 1, 1, 8])
    assert admit(bm, a2) == [0]  # a's prefix used again: now newer than b's
    bm.free(a2)
    assert free_order(bm) == [3, 1, 4, 2, 0]
    c = req("c", list(range(100, 113)))  # 4 blocks: evicts b's block 2, not a's block 0
    admit(bm, c)
    assert c.block_ids == [3, 1, 4, 2]
    assert hit_ids(bm, [1, 1, 1, 1, 7]) == [0]
    assert hit_ids(bm, [2, 2, 2, 2, 7]) == []


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, BS)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    before = free_order(bm)
    b = req("b", list(range(17)))  # hits 2 blocks but needs 3 more: 5 > 4
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert not bm.allocate_slots(b, 9, hits)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert free_order(bm) == before and len(bm.cached) == 2
    assert all(blk.ref_cnt == 0 for blk in bm.blocks)
    bm.check()


def test_preempted_request_rehits_its_own_blocks():
    bm = BlockManager(10, BS)
    a = req("a", list(range(10)))
    admit(bm, a)
    decode(bm, a, [100, 101, 102])
    bm.free(a)  # preempted: everything is recomputed from its tokens
    a.num_computed_tokens = 0
    assert admit(bm, a) == [0, 1, 2]  # 12 of its 13 tokens
    assert a.num_computed_tokens == 13


def test_uncache_drops_untrusted_content():
    bm = BlockManager(10, BS)
    a = req("a", list(range(10)))
    admit(bm, a)
    bm.uncache(a)
    bm.free(a)
    assert not bm.cached and bm.num_free_blocks == 10
    assert free_order(bm)[:3] == [0, 1, 2]  # nothing cached: reused first
    assert admit(bm, req("b", list(range(10)))) == []


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(10, BS)
    a, b = req("a", list(range(9))), req("b", list(range(20, 29)))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert sorted(blk.block_id for blk in bm.cached.values()) == [3, 4]  # b's, still in use
    assert admit(bm, req("a2", list(range(9)))) == []


def test_disabled_caching_shares_nothing():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", list(range(10)))
    admit(bm, a)
    assert admit(bm, b) == [] and b.block_ids == [3, 4, 5]
    assert not bm.cached


# ---- collisions and integrity ------------------------------------------------------------
def test_constant_hash_never_serves_a_block_twice(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids, extra=(): b"same")
    bm = BlockManager(10, BS)
    admit(bm, req("a", [7] * 12 + [1]))
    assert len(bm.cached) == 1  # every block has the same hash: only the first is cached
    b = req("b", [7] * 12 + [2])
    assert admit(bm, b) == [0]  # not [0, 0, 0]: block 0 holds positions 0-3 only
    assert len(set(b.block_ids)) == len(b.block_ids)
    assert admit(bm, req("c", [8] * 5)) == []  # same hash, other tokens


def test_collision_with_another_parent_is_a_miss(monkeypatch):
    # NOTE: a hash of the first token alone: blocks collide whatever precedes them.
    monkeypatch.setattr(block_manager, "hash_block",
                        lambda parent, token_ids, extra=(): bytes([token_ids[0]]))
    bm = BlockManager(16, BS)
    admit(bm, req("a", [1, 1, 1, 1, 5, 5, 5, 5, 0]))  # blocks 0 and 1 cached
    admit(bm, req("b", [2, 2, 2, 2, 5, 5, 5, 5, 0]))  # block 3 cached; its block 4 is not
    assert sorted(blk.block_id for blk in bm.cached.values()) == [0, 1, 3]
    # block 1 has the right tokens and hash but follows [1, 1, 1, 1]: not a hit
    assert admit(bm, req("c", [2, 2, 2, 2, 5, 5, 5, 5, 9])) == [3]
    assert admit(bm, req("d", [5, 5, 5, 5, 5, 5, 5, 5, 0])) == []  # block 1 is not a first block
    assert admit(bm, req("e", [1, 1, 1, 1, 5, 5, 5, 5, 9])) == [0, 1]
    for blk in bm.cached.values():
        assert len(blk.token_ids) == BS


def test_check_catches_corruption():
    bm = BlockManager(4, BS)
    a = req("a", list(range(6)))
    admit(bm, a)
    bm.check()
    bm.blocks[3].ref_cnt = 1  # referenced but still in the free queue
    with pytest.raises(AssertionError):
        bm.check()
    bm.blocks[3].ref_cnt = 0
    bm.blocks[0].block_hash = b"stale"
    with pytest.raises(AssertionError):
        bm.check()


def test_all_blocks_free_or_cached_after_a_workload():
    bm = BlockManager(8, BS)
    prefix = list(range(8))
    requests = [req(f"r{i}", prefix + [100 + i] * (i + 1)) for i in range(6)]
    running: list[Request] = []
    for r in requests:
        if len(running) == 2:
            bm.free(running.pop(0))
        admit(bm, r)
        running.append(r)
    for r in running:
        bm.free(r)
    bm.check()
    assert bm.num_free_blocks == 8 and all(blk.ref_cnt == 0 for blk in bm.blocks)
    assert bm.prefix_cache_hits == 5 * 8
    assert bm.prefix_cache_queries == sum(r.num_tokens for r in requests)
