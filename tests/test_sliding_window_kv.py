"""Sliding-window KV memory (kv_cache_manager.py, block_manager.py, kv_cache.py): a mixed
model's windowed layers hold only the blocks their window sees. Greedy output past several
windows equals the same engine keeping every block (`disable_hybrid_kv_cache_manager`, itself
equal to transformers: test_gemma3.py, and here under the slow mark), on the native kernels
and torch, under preemption and with prefix hits; the local group's blocks per request stay
bounded while the global group's grow. The tiny Gemma 3 ("gemma3_w32", tests/conftest.py):
a 32-token window, 16-token blocks.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_equivalence import hf_greedy, llm_greedy

from pagoda import LLM, SamplingParams
from pagoda.block_manager import NULL_BLOCK, BlockManager
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache import KVCacheSpec, kv_cache_groups, max_concurrency, num_blocks_for_groups
from pagoda.kv_cache_manager import HybridBlockManager
from pagoda.metrics import format_kv_memory_report
from pagoda.request import Request

ARCH = "gemma3_w32"
WINDOW, BS = 32, 16
MAX_TOKENS = 30


def _prompts(lens: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (n,), generator=g).tolist() for n in lens]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return llm_greedy(llm, prompts, max_tokens)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(ARCH)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=64, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def prompts():
    return _prompts((90, 23, 57))


@pytest.fixture(scope="module")
def whole_llm(model_dir):
    """The engine keeping every block of every layer (one KV cache group, as before)."""
    return LLM(str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=64, max_num_batched_tokens=32,
               disable_hybrid_kv_cache_manager=True)


@pytest.fixture(scope="module")
def reference(whole_llm, prompts):
    assert isinstance(whole_llm.engine.block_manager, BlockManager)
    return _generate(whole_llm, prompts)


@pytest.mark.slow
def test_generation_matches_hf(llm, model_dir, prompts):
    assert _generate(llm, prompts) == hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["native", "torch"])
def test_generation_past_several_windows_matches_whole_pool(native, model_dir, prompts, reference, monkeypatch, llm):
    from pagoda.layers import cpu_kernels

    if not native:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
        llm = LLM(str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=64, max_num_batched_tokens=32)
    assert isinstance(llm.engine.block_manager, HybridBlockManager)
    assert _generate(llm, prompts) == reference


def test_local_blocks_stay_bounded_while_global_blocks_grow(llm):
    engine = llm.engine
    engine.add_request("long", _prompts((40,), seed=4)[0],
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    request = engine.scheduler.waiting.peek({})
    held_local, held_full = [], []
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished:
            held_local.append(sum(1 for b in request.sliding_block_ids if b != NULL_BLOCK))
            held_full.append(len(request.block_ids))
    engine.check_integrity()
    text = format_kv_memory_report(engine.kv_report())
    assert "sliding-window layers (window 32)" in text and "maximum concurrency at max_model_len" in text
    assert max(held_local) <= WINDOW // BS + 2
    assert held_full[-1] == -(-(40 + 48) // BS) > max(held_local)
    assert engine.block_manager.sliding.num_free_blocks == engine.block_manager.sliding.num_usable_blocks


def test_preemption_keeps_outputs_exact(model_dir, reference, prompts):
    # NOTE: 14 full-attention blocks (and 15 local ones) hold two of the three requests (8, 4
    # and 6 blocks at their ends): the newest is preempted and recomputed.
    llm = LLM(str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=14, max_num_batched_tokens=32,
              enable_prefix_caching=False, max_model_len=192)
    assert _generate(llm, prompts) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_hits_reuse_the_last_window(llm, whole_llm):
    prefix = _prompts((80,), seed=7)[0]
    tails = _prompts((5, 19), seed=8)
    batch = [prefix + t for t in tails]
    _generate(llm, [prefix + [5]], max_tokens=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [80, 80]
    assert [o.outputs[0].token_ids for o in outs] == _generate(whole_llm, batch, 16)
    llm.engine.check_integrity()


# ---- block managers, no model --------------------------------------------------------------
def _request(request_id: str, n: int) -> Request:
    return Request(request_id, list(range(1000, 1000 + n)), SamplingParams(max_tokens=1000))


def _advance(bm: BlockManager | HybridBlockManager, request: Request, num_tokens: int) -> bool:
    if not bm.allocate_slots(request, num_tokens):
        return False
    request.num_computed_tokens += num_tokens
    return True


def _hybrid(num_full: int, num_local: int) -> HybridBlockManager:
    return HybridBlockManager(BlockManager(num_full, BS),
                              BlockManager(num_local, BS, False, sliding_window=WINDOW, group=1))


def test_sliding_manager_releases_blocks_behind_the_window():
    bm = BlockManager(8, BS, False, sliding_window=WINDOW)
    request = _request("a", 200)
    for _ in range(200):
        assert _advance(bm, request, 1)
        real = [b for b in request.sliding_block_ids or request.block_ids if b != NULL_BLOCK]
        assert len(real) <= WINDOW // BS + 2
        bm.check()
    # every table entry before the window is the null block, none after it
    first_seen = (200 - WINDOW) // BS
    assert request.block_ids[:first_seen - 1] == [NULL_BLOCK] * (first_seen - 1)
    assert NULL_BLOCK not in request.block_ids[first_seen:]
    bm.free(request)
    bm.check()
    assert bm.num_free_blocks == bm.num_usable_blocks == 7


def test_hybrid_allocation_is_all_or_nothing():
    bm = _hybrid(num_full=8, num_local=4)  # NOTE: 3 usable local blocks
    a = _request("a", 100)
    assert _advance(bm, a, 32)
    b = _request("b", 100)
    assert not bm.allocate_slots(b, 17)  # the local group lacks a block, the full one has them
    assert b.block_ids == [] and b.sliding_block_ids == [] and bm.full.num_free_blocks == 6
    assert _advance(bm, a, 16) and bm.sliding.num_free_blocks == 0
    assert _advance(bm, a, 16)  # the window moved on: a's first local block made room
    assert a.sliding_block_ids[0] == NULL_BLOCK and len(a.block_ids) == 4
    bm.check()
    bm.free(a)
    assert bm.full.num_free_blocks == 8 and bm.sliding.num_free_blocks == 3
    bm.check()


def test_hybrid_prefix_hit_needs_only_the_last_window_and_is_cut_without_it():
    bm = _hybrid(num_full=16, num_local=10)
    tokens = list(range(1000, 1100))
    first = Request("first", tokens, SamplingParams(max_tokens=10))
    assert _advance(bm, first, 100)
    bm.free(first)
    second = Request("second", tokens[:96] + [7, 8], SamplingParams(max_tokens=10))
    hits = bm.get_computed_blocks(second)
    assert len(hits) == 6  # 96 tokens: the full group has them, the local group its window
    assert bm.allocate_slots(second, 2, hits)
    assert second.num_computed_tokens == 96
    assert second.sliding_block_ids[:4] == [NULL_BLOCK] * 4  # keys from 96 - 32 + 1 = 65 on
    bm.check()
    bm.free(second)
    bm.sliding.reset_prefix_cache()  # the local blocks are gone: no hit survives
    third = Request("third", tokens[:96] + [9, 9], SamplingParams(max_tokens=10))
    assert bm.get_computed_blocks(third) == []
    bm.check()


def test_groups_split_the_pool_and_raise_concurrency():
    spec = KVCacheSpec(18, 1, 256, torch.bfloat16)
    groups = kv_cache_groups([512 if (i + 1) % 6 else None for i in range(18)], spec)
    specs = [g for g, _ in groups]
    assert [s.num_layers for s in specs] == [3, 15] and specs[1].sliding_window == 512
    assert len(kv_cache_groups([None] * 4, spec)) == 1 and len(kv_cache_groups([512] * 4, spec)) == 1
    cache = CacheConfig(kv_cache_memory_bytes=4 * 1024**3)
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=32768)
    full, local = num_blocks_for_groups(specs, cache, torch.device("cpu"), 32768, sched)
    assert full * specs[0].block_bytes(BS) + local * specs[1].block_bytes(BS) <= 4 * 1024**3
    assert local == 64 * 33 + 32 + 1  # every seat's window and a step's chunk
    before = 4 * 1024**3 // spec.block_bytes(BS) * BS / 32768
    assert max_concurrency(specs, [full, local], BS, 32768) > 4 * before
