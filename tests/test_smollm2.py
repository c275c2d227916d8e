"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on the same file."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_generate

from pagoda import LLM, SamplingParams
from pagoda.models.loader import load_hf_reference

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", max_model_len=512, kv_cache_memory="256MiB")


def _chat_ids(llm: LLM) -> list[list[int]]:
    return [list(llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False))
            for q in QUESTIONS]


def test_greedy_matches_transformers(llm):
    prompts = _chat_ids(llm)
    expected = hf_greedy_generate(load_hf_reference("smollm2", torch.float32), prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == expected
    llm.engine.check_integrity()


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
