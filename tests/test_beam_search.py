"""Beam search (vLLM's algorithm, pagoda/beam_search.py) on the tiny model in fp32, against
the same search driven by transformers' own logits; width 1 is greedy decoding; the server's
`use_beam_search` answers what `LLM.beam_search` finds."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import test_health as health
import torch

from pagoda import LLM, SamplingParams
from pagoda.beam_search import BeamSearchParams, BeamSearchSequence, beam_score
from pagoda.sampling_params import SamplingParamError

PROMPTS = [[1, 504, 3575, 282, 4649, 314, 7042, 30], [1, 2042, 905, 88, 3001]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(model, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> list[BeamSearchSequence]:
    """The same search, each step's logprobs from transformers (top 2 x width per beam)."""
    beams, completed = [BeamSearchSequence(list(prompt))], []
    for _ in range(params.max_tokens):
        if not beams:
            break
        grown = []
        for beam in beams:
            logprobs = model(torch.tensor([beam.tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * params.beam_width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp)
                (completed if token in eos and not params.ignore_eos else grown).append(child)
        beams = sorted(grown, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
        beams = beams[:params.beam_width]
    best = sorted(completed + beams, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
    return best[:params.beam_width]


def test_width_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for out, result in zip(greedy, beams, strict=True):
        (best,) = result.sequences
        assert best.tokens[len(out.prompt_token_ids):] == out.outputs[0].token_ids
        assert best.text == out.outputs[0].text and best.finish_reason == "length"


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_equal_the_search_on_transformers_logits(llm, hf_model, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=length_penalty)
    for prompt, result in zip(PROMPTS, llm.beam_search(PROMPTS, params), strict=True):
        want = reference(hf_model, prompt, params, set())
        assert [b.tokens for b in result.sequences] == [b.tokens for b in want]
        assert [b.cum_logprob for b in result.sequences] == pytest.approx([b.cum_logprob for b in want], abs=1e-4)
        assert len({tuple(b.tokens) for b in result.sequences}) == 3


def test_an_eos_completes_its_beam(llm, hf_model, monkeypatch):
    free = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    # NOTE: a token the search meets on its way is taken as the EOS, so some beam completes early.
    eos = {free[0].sequences[0].tokens[len(PROMPTS[0]) + 1]}
    monkeypatch.setattr(llm.engine, "eos_token_ids", eos)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    (result,) = llm.beam_search(PROMPTS[:1], params)
    want = reference(hf_model, PROMPTS[0], params, eos)
    assert [b.tokens for b in result.sequences] == [b.tokens for b in want]
    stopped = [b for b in result.sequences if b.finish_reason == "stop"]
    assert stopped and all(b.tokens[-1] in eos and len(b.tokens) < len(PROMPTS[0]) + 3 for b in stopped)


def test_bad_params_name_the_field():
    with pytest.raises(SamplingParamError) as e:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert e.value.param == "n"
    with pytest.raises(SamplingParamError) as e:
        BeamSearchParams(beam_width=2, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_the_server_answers_what_llm_beam_search_finds(llm, tiny_llama):
    (want,) = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    engine = health.make_engine(tiny_llama, None, dtype="float32", num_kv_blocks=64, max_model_len=256)

    async def post(body: dict) -> httpx.Response:
        async with health.app_client(engine) as client:
            return await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0],
                                                              "max_tokens": 4, **body})

    try:
        r = asyncio.run(post({"use_beam_search": True, "n": 2, "ignore_eos": True, "return_token_ids": True}))
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["token_ids"] for c in body["choices"]] == [b.tokens[len(PROMPTS[0]):] for b in want.sequences]
        assert [c["text"] for c in body["choices"]] == [b.text for b in want.sequences]
        assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
        assert body["usage"]["completion_tokens"] == 8
        refused = asyncio.run(post({"use_beam_search": True, "stream": True}))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"

        async def chat() -> httpx.Response:
            async with health.app_client(engine) as client:
                return await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "use_beam_search": True, "n": 2, "ignore_eos": True, "return_token_ids": True})

        r = asyncio.run(chat())
        assert r.status_code == 200, r.text
        body = r.json()
        (want,) = llm.beam_search([body["prompt_token_ids"]],
                                  BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
        assert [c["message"]["content"] for c in body["choices"]] == [b.text for b in want.sequences]
        assert [c["token_ids"] for c in body["choices"]] == [b.tokens[-3:] for b in want.sequences]
    finally:
        engine.shutdown()
