"""Engine behaviour on a tiny model: sampling, stops, limits, n > 1, logprobs, aborts."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2042, 905, 88, 3001]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256)


def _greedy(llm: LLM, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 24), ignore_eos=True, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _busy_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 49000, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_seeded_sampling_same_alone_and_in_busy_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    prompts = _busy_prompts(6) + [PROMPT] + _busy_prompts(3)
    params_list = [noisy] * 6 + [params] + [noisy] * 3
    busy = llm.generate(prompts, params_list, use_tqdm=False)[6].outputs[0].token_ids
    assert alone == busy
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=20,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert other_seed.token_ids != alone


def test_max_tokens_and_finish_reason(llm):
    out = _greedy(llm, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    ref = _greedy(llm).token_ids
    stop = ref[5]
    out = _greedy(llm, stop_token_ids=[stop])
    assert out.token_ids == ref[: ref.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_suppresses_stop_tokens(llm):
    ref = _greedy(llm).token_ids
    out = _greedy(llm, stop_token_ids=[ref[0]], min_tokens=4)
    assert len(out.token_ids) >= 4
    assert ref[0] not in out.token_ids[:4]


def test_stop_string_cut_and_included(llm):
    ref = _greedy(llm, max_tokens=32)
    text = ref.text
    assert len(text) > 20
    stop = text[10:14]
    first = text.index(stop)
    out = _greedy(llm, max_tokens=32, stop=[stop])
    assert out.text == text[:first] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = _greedy(llm, max_tokens=32, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[: first + len(stop)]


def test_stop_string_never_leaks_into_stream(llm):
    ref = _greedy(llm, max_tokens=32).text
    stop = ref[12:17]
    engine = llm.engine
    rid = engine.add_request(None, PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                streamed += out.outputs[0].text
                assert stop not in streamed
    assert streamed == ref[: ref.index(stop)]


def test_n_samples_match_seeded_children(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, o in enumerate(out.outputs):
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert o.token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs_match_reference(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    out = _greedy(llm, max_tokens=6, logprobs=3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.inference_mode():
        ref = model(ids).logits[0].log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for step, entry in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + step]
        top = row.topk(3)
        token = out.token_ids[step]
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids, strict=True)), abs=1e-3)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in _busy_prompts(4)]
    for _ in range(3):
        engine.step()
    out = engine.abort_request(ids[1])
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_prompt_validation(llm):
    from pagoda.engine import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="maximum context length is 256 tokens"):
        llm.engine.add_request(None, [5] * 256, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request(None, [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        llm.engine.add_request(None, [10**7], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_binding_the_pool_sets_nothing_on_the_model(llm):
    """The K/V pools are the runner's (`kv_caches`), reached through each step's metadata: binding
    them (again) changes no attention layer's state, and the native stack reads the runner's."""
    runner = llm.engine.runner
    layers = runner.model.attention_layers()
    assert list(runner.kv_caches) == layers
    before = [dict(vars(a)) for a in layers]
    saved = list(runner.kv_caches.values())
    runner.bind_kv_cache([(kv.k, kv.v) for kv in saved], [kv.group for kv in saved])
    assert [dict(vars(a)) for a in layers] == before and not hasattr(layers[0], "k_cache")
    assert all(now.k is was.k for now, was in zip(runner.kv_caches.values(), saved, strict=True))
    assert _greedy(llm, max_tokens=3).token_ids


def test_profile_forward_runs_a_full_budget_prefill(llm):
    from pagoda.engine_setup import profile_forward
    from pagoda.kv_cache import KVCacheSpec

    runner = llm.engine.runner
    d = runner.model.dims
    saved = list(runner.kv_caches.values())
    spec = KVCacheSpec(d.num_layers, d.num_kv_heads, d.head_dim, torch.float32)
    try:
        # NOTE: the CPU has nothing to measure; CUDA's peak is the activations of a full step.
        assert (profile_forward(runner, spec, llm.engine.config) > 0) == (runner.device.type == "cuda")
    finally:
        runner.bind_kv_cache([(kv.k, kv.v) for kv in saved], [kv.group for kv in saved])
    assert _greedy(llm, max_tokens=3).token_ids


def test_cuda_pool_is_this_engines_share_of_the_gpu(caplog):
    """As vLLM's per-instance gpu_memory_utilization: another engine's memory on the GPU does not
    shrink this one's share (a second engine at twice the share gets twice the pool), but the
    pool never takes more than is free."""
    from pagoda.engine_setup import cuda_kv_bytes

    gib = 2**30
    alone = cuda_kv_bytes(total=100 * gib, free=99 * gib, utilization=0.1, own=1 * gib, peak=gib // 2)
    assert alone == int(8.5 * gib)
    beside = cuda_kv_bytes(total=100 * gib, free=80 * gib, utilization=0.2, own=1 * gib, peak=gib // 2)
    assert beside == int(18.5 * gib)
    with caplog.at_level("WARNING", logger="pagoda"):
        assert cuda_kv_bytes(total=100 * gib, free=5 * gib, utilization=0.9, own=gib, peak=gib) == 4 * gib
    assert "less than gpu_memory_utilization=0.90" in caplog.text
    assert cuda_kv_bytes(total=100 * gib, free=50 * gib, utilization=0.01, own=2 * gib, peak=0) == 0


def test_pool_too_small_for_max_model_len_fails_at_start(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len=256.*--kv-cache-memory.*--max-model-len"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=4, max_model_len=256)


def test_priority_needs_the_priority_policy_and_orders_requests(tiny_llama):
    """vLLM's `priority` (lower first) under `scheduling_policy="priority"`; refused under fcfs."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=1,
              scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[:5], PROMPT[:7]], params, use_tqdm=False, priority=[5, 0, 1])
    first = sorted(outs, key=lambda o: o.metrics.first_token_time)
    assert [len(o.prompt_token_ids) for o in first] == [5, 7, len(PROMPT)]
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([PROMPT, PROMPT], params, priority=[1])
    fcfs = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.generate([PROMPT], params, priority=[2])
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        LLM(str(tiny_llama), scheduling_policy="lifo")


def test_vllm_prompt_dicts_run_as_their_text_or_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = llm.tokenizer.decode(PROMPT[1:])
    plain = [out.outputs[0].token_ids for out in llm.generate([PROMPT, text], params, use_tqdm=False)]
    dicts = llm.generate([{"prompt_token_ids": PROMPT, "prompt": "its text, not run"}, {"prompt": text}],
                         params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in dicts] == plain
    alone = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == plain[0]


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "'multi_modal_data' is not supported"),
    ({"prompt_token_ids": PROMPT, "cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"prompt_embeds": [[0.0]]}, "'prompt_embeds' is not supported"),
    ({"promt": "hi"}, "Unknown prompt field 'promt'"),
    ({"prompt_token_ids": "1 2 3"}, "must be a list of token ids"),
    ({}, "needs 'prompt'"),
])
def test_a_prompt_dict_pagoda_cannot_serve_is_refused_by_name(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_logprobs_mode_reaches_the_sampler(tiny_llama):
    """--logprobs-mode raw_logits: the same tokens and ranks, values that differ from the
    raw log-probabilities by one constant a position (the row's log-sum-exp)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = {}
    for mode in ("raw_logprobs", "raw_logits"):
        llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=64, logprobs_mode=mode)
        outs[mode] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert outs["raw_logprobs"].token_ids == outs["raw_logits"].token_ids
    for lps, lgs in zip(outs["raw_logprobs"].logprobs, outs["raw_logits"].logprobs, strict=True):
        assert lps.keys() == lgs.keys() and all(lps[t].rank == lgs[t].rank for t in lps)
        shifts = {round(lgs[t].logprob - lps[t].logprob, 3) for t in lps}
        assert len(shifts) == 1 and shifts != {0.0}
