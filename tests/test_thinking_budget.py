"""vLLM's `thinking_token_budget`: the forcing rule alone, then through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.sampling_params import SamplingParams
from pagoda.thinking_budget import ThinkingBudget, ThinkingTokens

START, END = (90, 91), (95, 96, 97)
MARKS = ThinkingTokens(start=START, end=END, natural_end=(96, 97))


def forced_run(prompt: list[int], free: list[int], budget: int) -> list[int]:
    """The output when the model would write `free` and the budget forces what it must."""
    rule, out = ThinkingBudget(budget, MARKS), []
    for token in free:
        forced = rule.forced_token(prompt + out, len(prompt))
        out.append(token if forced is None else forced)
    return out


def test_a_section_opened_by_the_output_is_cut_after_budget_tokens():
    free = [5, *START, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert forced_run([1, 2], free, 3) == [5, *START, 1, 2, 3, *END, 7, 8, 9, 10]
    assert forced_run([1, 2], free, 0) == [5, *START, *END, 4, 5, 6, 7, 8, 9, 10]
    assert forced_run([1, 2], free, 100) == free


def test_a_model_that_closes_in_time_is_left_alone_and_a_new_section_gets_a_new_budget():
    closes = [*START, 1, 2, 96, 97, 8, 8]
    assert forced_run([3], closes, 4) == closes
    # NOTE: as vLLM's, the closing tokens count against the budget: one too few, and the
    # forced end follows the half-written one
    assert forced_run([3], closes, 3) == [*START, 1, 2, 96, *END]
    again = [*START, 1, 96, 97, *START, 4, 4, 4, 4, 4, 4, 4]
    assert forced_run([3], again, 3) == [*START, 1, 96, 97, *START, 4, 4, 4, *END, 4]


def test_a_prompt_that_opened_the_thinking_counts_its_tokens():
    prompt = [7, *START, 1, 1]
    assert forced_run(prompt, [2] * 8, 4) == [2, 2, *END, 2, 2, 2]
    # NOTE: already past the budget in the prompt: the end comes first (vLLM's in_end at init)
    assert forced_run(prompt, [2] * 5, 1) == [*END, 2, 2]
    assert forced_run([7, *START, 1, 96, 97], [2] * 5, 0) == [2] * 5  # a closed section


def test_the_params_refuse_bad_budgets_with_vllms_words():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="non-negative integer or -1") as e:
            SamplingParams(thinking_token_budget=bad)  # type: ignore[arg-type]
        assert e.value.param == "thinking_token_budget"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_model_len=256,
               reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": " Enough.</think>",
                                 "natural_end_str": "</think>"})


def test_the_engine_forces_the_end_after_the_budget(llm: LLM):
    tok = llm.get_tokenizer()
    # NOTE: the markers as the engine tokenizes them (in a text, "?<" would merge into one token)
    prompt = tok.encode("Question: why?", add_special_tokens=False) + tok.encode("<think>", add_special_tokens=False)
    end = tok.encode(" Enough.</think>", add_special_tokens=False)
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    for budget in (0, 5):
        out = llm.generate([prompt], SamplingParams(**greedy, thinking_token_budget=budget),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:budget] == free[:budget]
        assert out.token_ids[budget:budget + len(end)] == end, (free, out.token_ids)
        assert out.token_ids != free
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                                                    thinking_token_budget=2), use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids[2:2 + len(end)] == end
    plain = tok.encode("No thinking here", add_special_tokens=False)
    unforced = llm.generate([plain], SamplingParams(**greedy, thinking_token_budget=0), use_tqdm=False)
    assert unforced[0].outputs[0].token_ids == llm.generate([plain], SamplingParams(**greedy),
                                                            use_tqdm=False)[0].outputs[0].token_ids


def test_a_budget_without_a_reasoning_config_is_refused(tiny_llama: Path):
    plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match="reasoning_config is not configured") as e:
        plain.engine.add_request(None, [1, 2, 3], SamplingParams(thinking_token_budget=4))
    assert e.value.param == "thinking_token_budget"  # type: ignore[attr-defined]


def test_the_http_field_and_the_serve_flags(tiny_llama: Path):
    """`thinking_token_budget` over HTTP (completions and chat), and the engine's markers from
    `--reasoning-parser` and `--reasoning-config` as vLLM fills them."""
    import test_health as health
    from test_server_api import serve_parser

    from pagoda.server.serve import engine_kwargs

    def config(*flags: str):
        return engine_kwargs(serve_parser().parse_args(["serve", "m", *flags])).get("reasoning_config")

    assert config() is None
    parsed = config("--reasoning-parser", "qwen3")
    assert (parsed.reasoning_start_str, parsed.reasoning_end_str, parsed.natural_end_str) == \
        ("<think>", "</think>", "</think>")
    custom = config("--reasoning-parser", "deepseek_r1", "--reasoning-config",
                    '{"reasoning_end_str": " Time is up.</think>"}')
    assert (custom.reasoning_start_str, custom.reasoning_end_str, custom.natural_end_str) == \
        ("<think>", " Time is up.</think>", "</think>")
    with pytest.raises(ValueError, match="Unknown reasoning_config key"):
        config("--reasoning-config", '{"reasoning_end": "x"}')

    engine = health.make_engine(tiny_llama, None, dtype="float32", num_kv_blocks=64, max_model_len=128,
                                reasoning_config=config("--reasoning-parser", "qwen3"))
    try:
        tok = engine.tokenizer
        end = tok.encode("</think>", add_special_tokens=False)
        prompt = tok.encode("Why?", add_special_tokens=False) + tok.encode("<think>", add_special_tokens=False)
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "thinking_token_budget": 4}
        got = health.post(engine, "/v1/completions", body).json()["choices"][0]["token_ids"]
        assert got[4:4 + len(end)] == end
        unlimited = health.post(engine, "/v1/completions", {**body, "thinking_token_budget": -1})
        assert unlimited.json()["choices"][0]["token_ids"] != got
        bad = health.post(engine, "/v1/completions", {**body, "thinking_token_budget": -5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "thinking_token_budget": 0}
        assert health.post(engine, "/v1/chat/completions", chat).status_code == 200
    finally:
        engine.shutdown()
