"""Speculative decoding inside continuous batching: exact for greedy, faithful for sampling.

The draft model here is the target itself, so nearly every draft is accepted and every path
runs (multi-row verification, max_tokens inside a draft, stop strings, rollbacks after the
pool runs dry). Greedy output must equal the run without speculation, token for token, in
every configuration; sampled output must follow the same distribution (a two-sample
chi-square over many seeds). Prompt lookup is checked on the real SmolLM2 copying a passage.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from conftest import requires_smollm2

from pagoda import LLM, SamplingParams
from pagoda.metrics.base import StatLoggerBase
from pagoda.stats import IterationStats, SchedulerStats

ENGINE = dict(dtype="float32", max_model_len=256)


class SpecStats(StatLoggerBase):
    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        spec = iteration_stats.spec_decoding if iteration_stats else None
        if spec is not None:
            self.drafts += spec.num_drafts
            self.draft_tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens

    def log(self) -> None:
        """Nothing periodic."""


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (int(torch.randint(3, 60, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def run(llm: LLM, params: SamplingParams | list[SamplingParams], ps: list[list[int]]
        ) -> list[list[int]]:
    outs = llm.generate(ps, params, use_tqdm=False)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), num_kv_blocks=256, **ENGINE)


def spec_llm(tiny_llama: Path, k: int = 3, **engine: object) -> tuple[LLM, SpecStats]:
    args = {**ENGINE, "num_kv_blocks": 256, **engine}
    llm = LLM(str(tiny_llama), speculative_config={"model": str(tiny_llama),
                                                   "num_speculative_tokens": k}, **args)
    stats = SpecStats()
    llm.engine.stat_loggers.append(stats)
    return llm, stats


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill, drafts trimmed by the budget
    {"num_kv_blocks": 10, "block_size": 16, "max_model_len": 128},  # preemption
    {"block_size": 8, "enable_prefix_caching": True},
])
def test_greedy_is_identical_with_speculation(tiny_llama: Path, plain: LLM, engine: dict):
    ps = prompts() + [[1] + [5, 6, 7, 8] * 8] * 2  # two equal prompts share cached blocks
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (30, 17, 41, 5, 23, 2, 30, 29)]
    expected = run(plain, params, ps)
    llm, stats = spec_llm(tiny_llama, **engine)
    assert run(llm, params, ps) == expected
    assert stats.drafts > 10 and stats.accepted > 0.8 * stats.draft_tokens
    if engine.get("num_kv_blocks"):
        assert llm.engine.scheduler.num_preemptions > 0


def test_stop_strings_and_eos_inside_a_draft(tiny_llama: Path, plain: LLM):
    ref = plain.generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=40,
                                                         ignore_eos=True), use_tqdm=False)
    text, tokens = ref[0].outputs[0].text, ref[0].outputs[0].token_ids
    stop = text[len(text) // 2: len(text) // 2 + 3]
    llm, _ = spec_llm(tiny_llama, k=4)
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[13]])):
        want = plain.generate([prompts()[0]], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompts()[0]], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
    llm.engine.check_integrity()


def test_requests_that_cannot_draft_share_the_batch(tiny_llama: Path, plain: LLM):
    ps = prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=10)]
    llm, stats = spec_llm(tiny_llama)
    assert run(llm, params, ps) == run(plain, params, ps)
    assert stats.drafts > 0


def test_disable_by_batch_size(tiny_llama: Path):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, **ENGINE, speculative_config={
        "model": str(tiny_llama), "num_speculative_tokens": 2, "disable_by_batch_size": 3})
    stats = SpecStats()
    llm.engine.stat_loggers.append(stats)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run(llm, params, prompts(3))
    assert stats.drafts == 0
    run(llm, params, prompts(2))
    assert stats.drafts > 0


def test_sampling_follows_the_target_distribution(tiny_llama: Path, plain: LLM):
    """Token frequencies at positions 2-4 over many seeds, with and without speculation."""
    llm, stats = spec_llm(tiny_llama, k=3)
    prompt = prompts(1)[0]
    num = 200
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=4, ignore_eos=True, seed=s)
              for s in range(num)]
    counts = []
    for engine in (plain, llm):
        outs = run(engine, params, [prompt] * num)
        counts.append(collections.Counter((pos, tok) for out in outs
                                          for pos, tok in enumerate(out) if pos >= 1))
    assert stats.drafts > 0 and 0 < stats.accepted < stats.draft_tokens
    keys = set(counts[0]) | set(counts[1])
    chi2 = sum((counts[0][k] - counts[1][k]) ** 2 / (counts[0][k] + counts[1][k]) for k in keys
               if counts[0][k] + counts[1][k] >= 10)
    dof = sum(1 for k in keys if counts[0][k] + counts[1][k] >= 10) - 3
    # NOTE: a two-sample chi-square; mean dof, sd sqrt(2 dof): 5 sd is a ~1e-6 false alarm.
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


def test_quantized_draft_keeps_greedy_output(tiny_llama: Path, plain: LLM):
    """vLLM's `quantization` key quantizes the draft alone; the target's output is unchanged."""
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = run(plain, params, ps)
    llm = LLM(str(tiny_llama), num_kv_blocks=256, speculative_config={
        "model": str(tiny_llama), "num_speculative_tokens": 3, "quantization": "int8"}, **ENGINE)
    stats = SpecStats()
    llm.engine.stat_loggers.append(stats)
    assert run(llm, params, ps) == expected
    assert stats.drafts > 10 and stats.accepted > 0
    draft = llm.engine.proposer.runner.model  # type: ignore[union-attr]
    target = llm.engine.runner.model
    assert {m.method.name for m in draft.modules() if hasattr(m, "method")} == {"int8 (channel)"}
    assert {m.method.name for m in target.modules() if hasattr(m, "method")} == {"unquantized"}


def test_bad_speculative_configs_are_refused(tiny_llama: Path):
    for bad, words in [({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "[1, 16]"),
                       ({"method": "draft_model"}, "model"), ('{"oops', "JSON"),
                       ({"bogus": 1}, "Unknown"), ({"model": "smollm2", "quantization": "int3"}, "quantization")]:
        with pytest.raises(ValueError, match=words):
            LLM(str(tiny_llama), speculative_config=bad, **ENGINE)


@requires_smollm2
def test_prompt_lookup_on_smollm2_copying_a_passage():
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen "
               "liquor jugs. How vexingly quick daft zebras jump!")
    llm = LLM("smollm2", dtype="float32", max_model_len=512, kv_cache_memory="128MiB")
    question = [{"role": "user", "content": f"Repeat this text exactly: {passage}"}]
    prompt = llm.tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = run(llm, params, [prompt])
    spec = LLM("smollm2", dtype="float32", max_model_len=512, kv_cache_memory="128MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 3})
    stats = SpecStats()
    spec.engine.stat_loggers.append(stats)
    assert run(spec, params, [prompt]) == expected
    assert stats.accepted > 0.5 * stats.draft_tokens > 10


def test_constrained_requests_draft_within_their_grammar(tiny_llama: Path, plain: LLM):
    from pagoda.structured_output import StructuredOutputsParams

    pattern = r"(ab|cd|ef){4,20}"
    params = [SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=pattern)),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    ps = prompts(2)
    want = plain.generate(ps, params, use_tqdm=False)
    llm, stats = spec_llm(tiny_llama)
    got = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    import re

    assert re.fullmatch(pattern, got[0].outputs[0].text)
    # NOTE: an n-gram proposer sees the regex's repeats; the draft model's free guesses
    # rarely fit the grammar, so drafting here is checked with prompt lookup.
    lookup = LLM(str(tiny_llama), num_kv_blocks=256, **ENGINE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    lookup_stats = SpecStats()
    lookup.engine.stat_loggers.append(lookup_stats)
    out = lookup.generate([ps[0]], params[0], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[0].outputs[0].token_ids
    assert lookup_stats.drafts > 0 and lookup_stats.accepted > 0
