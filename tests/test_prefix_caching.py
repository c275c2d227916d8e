"""Prefix caching end to end on a tiny model: the same tokens as transformers, cache or not.

A shared-prefix workload (one 64-token "system prompt", different questions) goes through
the engine cold and warm, chunked, preempted, with n > 1 and with aborts; greedy outputs must
equal Hugging Face's on the same weights, sampled ones must equal the uncached engine's, and
afterwards every block must be free (cached or not) with no reference left.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.llm import merge_delta
from pagoda.outputs import RequestOutput

PREFIX_LEN = 64
SUFFIX_LENS = [5, 17, 0, 30, 1]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _workload() -> list[list[int]]:
    """Prompts sharing a 64-token prefix (one is the prefix alone), plus one diverging at 20."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(100, 49000, (PREFIX_LEN,), generator=g).tolist()
    prompts = [prefix + torch.randint(100, 49000, (n,), generator=g).tolist() for n in SUFFIX_LENS]
    return prompts + [prefix[:20] + torch.randint(100, 49000, (12,), generator=g).tolist()]


PROMPTS = _workload()


def expected_hit(prompt: list[int], block_size: int) -> int:
    """Tokens a warm request reuses: whole blocks of the shared prefix, never its last token."""
    shared = 0
    while shared < min(len(prompt) - 1, PREFIX_LEN) and prompt[shared] == PROMPTS[0][shared]:
        shared += 1
    return shared // block_size * block_size


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Transformers' greedy continuations of PROMPTS on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def make_llm(model_dir, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", **engine_args)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_clean(llm: LLM) -> None:
    """After all requests: every block free, unreferenced, and either cached or blank."""
    llm.engine.check_integrity()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_cnt == 0
        assert block.block_hash is None or bm.cached[block.block_hash] is block


@pytest.mark.parametrize("budget", [4096, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cold_then_warm_matches_reference(block_size, budget, tiny_llama, reference):
    llm = make_llm(tiny_llama, block_size=block_size, num_kv_blocks=4096 // block_size,
                   max_num_batched_tokens=budget)
    cold = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert token_ids(cold) == reference[:1] and cold[0].num_cached_tokens == 0
    warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the first request again, and the rest
    assert token_ids(warm) == reference
    cached = [o.num_cached_tokens for o in warm]
    assert cached == [expected_hit(p, block_size) for p in PROMPTS]
    assert all(c > 0 and c % block_size == 0 for c in cached[:len(SUFFIX_LENS)])
    assert cached[2] == PREFIX_LEN - block_size  # the prefix alone: its last block is computed
    stats = llm.engine.scheduler_stats()
    assert stats.prefix_cache_queries == len(PROMPTS[0]) + sum(len(p) for p in PROMPTS)
    assert stats.prefix_cache_hits == sum(cached)
    assert_pool_clean(llm)


def test_disabled_matches_reference_and_reports_nothing(tiny_llama, reference):
    llm = make_llm(tiny_llama, num_kv_blocks=256, enable_prefix_caching=False)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(warm) == reference
    assert all(o.num_cached_tokens == 0 for o in warm)
    bm = llm.engine.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, len(bm.cached)) == (0, 0, 0)
    assert_pool_clean(llm)


def test_cold_batch_shares_blocks_within_a_step(tiny_llama, reference):
    # NOTE: all arrive at once on an empty cache: later requests hit blocks the first one
    # is computing in the same step (and, chunked, in the steps before).
    for budget in (4096, 24):
        llm = make_llm(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=budget)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(outs) == reference
        assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == PREFIX_LEN
        assert_pool_clean(llm)


def test_preemption_with_shared_blocks(tiny_llama, reference):
    # NOTE: 12 blocks of 16 for six requests of up to 110 tokens (7 blocks each, 4 shared).
    llm = make_llm(tiny_llama, num_kv_blocks=12, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert_pool_clean(llm)


def test_parallel_samples_with_seed_match_uncached(tiny_llama):
    # NOTE: no transformers reference for seeded sampling; the uncached engine (equal to
    # transformers when greedy, above) is the reference.
    params = SamplingParams(n=3, temperature=0.8, seed=123, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for enabled in (True, False):
        llm = make_llm(tiny_llama, num_kv_blocks=256, enable_prefix_caching=enabled,
                       max_num_batched_tokens=48)
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        results[enabled] = [[s.token_ids for s in o.outputs] for o in outs]
        if enabled:
            assert llm.engine.block_manager.prefix_cache_hits >= 5 * PREFIX_LEN
        assert_pool_clean(llm)
    assert results[True] == results[False]
    assert len({tuple(s) for s in results[True][0]}) == 3  # the samples really differ


def _drain(llm: LLM, results: dict[str, RequestOutput]) -> None:
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)


def test_abort_midway_keeps_others_exact(tiny_llama, reference):
    llm = make_llm(tiny_llama, num_kv_blocks=256, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.engine
    for i in range(5):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    results: dict[str, RequestOutput] = {}
    for _ in range(4):
        for delta in engine.step():
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
    queued = [*engine.scheduler.running, *engine.scheduler.waiting]
    r3, r4 = (next(r for r in queued if r.request_id == rid) for rid in ("r3", "r4"))
    assert PREFIX_LEN < r3.num_computed_tokens < r3.num_tokens  # mid-prefill, after its hit
    assert r4.num_computed_tokens == 0 and not r4.block_ids  # still waiting
    num_done = r3.num_computed_tokens
    engine.check_integrity()
    assert engine.abort_request("r3") is not None
    assert engine.abort_request("r4") is not None
    engine.check_integrity()
    _drain(llm, results)
    for i in (0, 1, 2):
        assert results[f"r{i}"].outputs[0].token_ids == reference[i]
    assert_pool_clean(llm)
    # what the aborted request computed is sound: asking again reuses all its full blocks
    again = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference[3]
    assert again.num_cached_tokens == num_done // 16 * 16 > PREFIX_LEN
    assert_pool_clean(llm)


def test_failed_step_uncaches_its_blocks(tiny_llama, reference, monkeypatch):
    llm = make_llm(tiny_llama, num_kv_blocks=256)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    real_execute = llm.engine.runner.execute

    def fail_once(sched):
        monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
        raise RuntimeError("injected")

    bm = llm.engine.block_manager
    before = bm.get_computed_blocks(_probe(PROMPTS[3]))
    assert before, "the shared prefix should be cached by the first request"
    monkeypatch.setattr(llm.engine.runner, "execute", fail_once)
    failed = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    assert failed.error is not None and failed.outputs[0].finish_reason == "error"
    # blocks computed before the failed step stay cached; nothing the failed step wrote is named
    assert bm.get_computed_blocks(_probe(PROMPTS[3])) == before
    out = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[3]
    assert_pool_clean(llm)


def _probe(prompt: list[int]):
    from pagoda.request import Request

    return Request("probe", prompt, GREEDY)


def test_benchmark_command_runs(tiny_llama, tmp_path):
    # NOTE: a smoke test of the command and its bookkeeping; timings are not asserted.
    import argparse
    import json

    from pagoda.bench.prefix_caching import add_prefix_caching_parser

    parser = argparse.ArgumentParser()
    add_prefix_caching_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "pc.json"
    args = parser.parse_args(["prefix-caching", "--model", str(tiny_llama), "--dtype", "float32",
                              "--system-prompt-len", "100", "--num-warm", "2", "--num-rounds", "1",
                              "--save-result", str(out)])
    assert args.func(args) == 0
    saved = json.loads(out.read_text())
    rows = [(m["mode"], m["kind"], m["cached_tokens"]) for m in saved["measurements"]]
    assert [r[:2] for r in rows] == [("caching", "warmup"), ("caching", "cold"), ("caching", "warm"),
                                     ("caching", "warm"), ("baseline", "warmup"),
                                     ("baseline", "cold"), ("baseline", "warm"), ("baseline", "warm")]
    shared = saved["shared_prefix_tokens"]
    assert shared >= 100
    assert [r[2] for r in rows if r[1] != "warmup"] == [0, shared // 16 * 16, shared // 16 * 16, 0, 0, 0]
    assert saved["summary"]["warm_over_cold"] > 0


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own_salt(tiny_llama, reference):
    """vLLM's `cache_salt`: a prefix cached under one salt (or none) is a miss for any other,
    so one tenant cannot reuse, or time, another's prompts; the same salt hits, and the
    outputs stay transformers'."""
    llm = make_llm(tiny_llama, block_size=16, num_kv_blocks=256)
    warm = PROMPTS[0]
    expected = expected_hit(PROMPTS[1], 16)

    def run(prompt: list[int], salt: str | None) -> RequestOutput:
        request = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return llm.generate([request], GREEDY, use_tqdm=False)[0]

    run(warm, None)
    first = [run(PROMPTS[1], salt) for salt in ("tenant-a", "tenant-b", "tenant-a", None)]
    again = (len(PROMPTS[1]) - 1) // 16 * 16  # NOTE: tenant-a's first run cached the whole prompt
    assert [o.num_cached_tokens for o in first] == [0, 0, again, expected]
    assert all(o.outputs[0].token_ids == reference[1] for o in first)
    assert run(PROMPTS[3], "tenant-b").num_cached_tokens == expected_hit(PROMPTS[3], 16)
    assert_pool_clean(llm)
