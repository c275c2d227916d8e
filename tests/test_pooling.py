"""Pooling (vLLM's embed/encode): pooled requests end with their prompt's final-norm hidden
states (the last row, or the mean of every row), generating nothing.

Every vector is compared with transformers' last hidden state (after the final norm) of the
same tiny random float32 model on the same prompt: the whole prompt in one step, spread over
several chunked-prefill steps beside generating requests (whose greedy tokens must be
transformers' too), after preemption, and over HTTP (/v1/embeddings, /pooling, score, rerank).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import test_health as health
import torch
from conftest import hf_greedy_generate

from pagoda import LLM, PoolingParams, RequestOutput, SamplingParams
from pagoda.async_engine import AsyncLLM
from pagoda.llm import merge_delta
from pagoda.pooling import PoolerConfig, finish_vector
from pagoda.sampling_params import SamplingParamError

TOL = 1e-4  # NOTE: float32 both sides; the paged attention sums in another order.


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(100, 49000, (n - 1,), generator=g).tolist()


PROMPTS = [_prompt(37, 1), _prompt(9, 2), _prompt(1, 3)]


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_hidden(hf_model):
    """transformers' final-norm hidden states of a prompt (hidden_states[-1], float32)."""

    def of(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
            last = out.hidden_states[-1][0]
            # NOTE: Llama's hidden_states[-1] is taken after the final norm: the LM head's input.
            torch.testing.assert_close(hf_model.lm_head(last), out.logits[0])
        return last

    return of


def reference(hf_hidden, prompt: list[int], params: PoolingParams) -> list[float]:
    rows = hf_hidden(prompt)
    return finish_vector(rows.sum(0) if params.pools_every_row else rows[-1],
                         len(prompt) if params.pools_every_row else 1, params)


def assert_vectors(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert torch.tensor(got) == pytest.approx(torch.tensor(want), abs=TOL)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    """Chunked prefill: a 16-token budget, so the 37-token prompt spans three steps."""
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=128,
               block_size=8, max_num_batched_tokens=16)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embed_matches_transformers(llm: LLM, hf_hidden, pooling_type: str, normalize: bool):
    params = PoolingParams(pooling_type=pooling_type, normalize=normalize)  # type: ignore[arg-type]
    outs = llm.embed(PROMPTS, params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.prompt_token_ids == prompt and out.outputs.hidden_size == 64
        assert_vectors(out.outputs.embedding, reference(hf_hidden, prompt, params))
    if normalize:
        assert sum(x * x for x in outs[0].outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    llm.engine.check_integrity()


def test_pooled_requests_beside_generating_ones(llm: LLM, hf_model, hf_hidden):
    """Pooled prompts share chunked steps with generating ones, whose greedy tokens stay
    transformers'; a pooled request generates nothing."""
    engine = llm.engine
    gen = [_prompt(21, 7), _prompt(5, 8)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mean = PoolingParams(pooling_type="MEAN")
    steps: list[list[int]] = []
    execute = engine.runner.execute

    def counting(out):  # noqa: ANN001, ANN202
        steps.append(list(out.num_scheduled_tokens))
        return execute(out)

    engine.runner.execute = counting  # type: ignore[method-assign]
    try:
        gen_ids = [engine.add_request(None, p, greedy) for p in gen]
        pooled = [engine.add_processed(engine.processor.process_pooling(engine.new_id(), p, mean))
                  for p in PROMPTS[:2]]
        finals: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                finals[out.request_id] = merge_delta(finals.get(out.request_id), out)
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    assert any(len(s) > 2 for s in steps) and max(sum(s) for s in steps) <= 16
    tokens = [finals[i].outputs[0].token_ids for i in gen_ids]
    assert tokens == hf_greedy_generate(hf_model, gen, 8)
    for request_id, prompt in zip(pooled, PROMPTS[:2], strict=True):
        out = finals[request_id]
        assert out.finished and out.outputs[0].token_ids == []
        assert out.outputs[0].finish_reason == "stop"
        assert out.pooled is not None
        assert_vectors(out.pooled, reference(hf_hidden, prompt, mean))
    engine.check_integrity()


def test_preempted_pooled_request_pools_each_row_once(tiny_llama: Path, hf_hidden):
    """A pool too small for both: the pooled prompt is preempted mid-prefill by a growing
    generation, then recomputed from its first token (its rows summed once)."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=6, max_model_len=48, block_size=8,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    engine, prompt = llm.engine, _prompt(40, 11)
    mean = PoolingParams(pooling_type="MEAN", normalize=False)
    engine.add_request(None, _prompt(10, 12), SamplingParams(max_tokens=30, ignore_eos=True))
    request_id = engine.add_processed(engine.processor.process_pooling("pooled", prompt, mean))
    pooled = [o.pooled for _ in range(200) if engine.has_unfinished_requests()
              for o in engine.step() if o.request_id == request_id and o.finished]
    assert engine.scheduler.num_preemptions > 0 and pooled[0] is not None
    assert_vectors(pooled[0], reference(hf_hidden, prompt, mean))
    engine.check_integrity()


def test_prefix_cache_serves_last_pooling_not_mean(tiny_llama: Path, hf_hidden):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=128,
              block_size=8, enable_prefix_caching=True)
    prompt = PROMPTS[0]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # NOTE: warms the cache
    engine = llm.engine
    for pooling_type, cached in (("LAST", 32), ("MEAN", 0)):
        params = PoolingParams(pooling_type=pooling_type)  # type: ignore[arg-type]
        request_id = engine.add_processed(engine.processor.process_pooling(engine.new_id(), prompt, params))
        outs = [o for _ in range(8) if engine.has_unfinished_requests() for o in engine.step()]
        final = next(o for o in outs if o.request_id == request_id and o.finished)
        assert final.num_cached_tokens == cached and final.pooled is not None
        assert_vectors(final.pooled, reference(hf_hidden, prompt, params))


# NOTE: slow (two workers start, as test_prompt_logprobs' parallel test) to keep the default
# suite within its budget; passed when written (2026-12-02). `pytest -m slow` runs it.
@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallel_workers_pool(tiny_llama: Path, hf_hidden, parallel: dict):
    """The parallel executor: the last stage's workers return the pooled parts (chunked)."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=128,
              max_num_batched_tokens=16, **parallel)
    try:
        for pooling_type in ("LAST", "MEAN"):
            params = PoolingParams(pooling_type=pooling_type)  # type: ignore[arg-type]
            outs = llm.embed(PROMPTS[:2], params, use_tqdm=False)
            for out, prompt in zip(outs, PROMPTS, strict=False):
                assert_vectors(out.outputs.embedding, reference(hf_hidden, prompt, params))
    finally:
        llm.engine.shutdown()


def test_dimensions_follow_vllm_matryoshka_rules():
    plain, matryoshka = PoolerConfig(64), PoolerConfig(64, is_matryoshka=True)
    with pytest.raises(SamplingParamError, match="does not support matryoshka"):
        plain.check(PoolingParams(dimensions=16))
    with pytest.raises(SamplingParamError, match="at most the model's 64"):
        matryoshka.check(PoolingParams(dimensions=65))
    with pytest.raises(SamplingParamError, match="only supports"):
        PoolerConfig(64, True, (16, 32)).check(PoolingParams(dimensions=8))
    with pytest.raises(SamplingParamError, match="at least 1"):
        PoolingParams(dimensions=0)
    matryoshka.check(PoolingParams(dimensions=16))
    vector = torch.arange(1.0, 65.0)
    cut = finish_vector(vector, 1, PoolingParams(dimensions=4))
    assert cut == pytest.approx((vector[:4] / vector[:4].norm()).tolist())
    assert finish_vector(vector * 2, 2, PoolingParams(normalize=False)) == vector.tolist()


# ---- HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matryoshka_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its config declaring Matryoshka embeddings (so `dimensions` is allowed)."""
    out = tmp_path_factory.mktemp("tiny_matryoshka")
    for f in tiny_llama.iterdir():
        (out / f.name).symlink_to(f)
    config = json.loads((tiny_llama / "config.json").read_text())
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return out


@pytest.fixture(scope="module")
def server(matryoshka_model: Path) -> Iterator[AsyncLLM]:
    eng = health.make_engine(matryoshka_model, None, dtype="float32", num_kv_blocks=64,
                             max_model_len=128, max_num_batched_tokens=32)
    yield eng
    eng.shutdown()


post = health.post


def test_openai_client_embeddings_float_and_base64(server: AsyncLLM, hf_hidden):
    texts = ["The quick brown fox", "jumps over the lazy dog"]

    async def main() -> list:
        async with health.app_client(server) as http:
            api = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            return [await api.embeddings.create(model="tiny", input=texts, encoding_format="float"),
                    await api.embeddings.create(model="tiny", input=texts),  # NOTE: base64, decoded
                    await api.embeddings.create(model="tiny", input=texts, encoding_format="base64"),
                    await api.embeddings.create(model="tiny", input=texts[0], dimensions=16)]

    as_float, decoded, raw, cut = asyncio.run(main())
    ids = [server.tokenizer.encode(t) for t in texts]
    assert as_float.object == "list" and as_float.model == "tiny"
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    for item, prompt, index in zip(as_float.data, ids, range(2), strict=True):
        assert item.object == "embedding" and item.index == index
        assert_vectors(item.embedding, reference(hf_hidden, prompt, PoolingParams()))
    for a, b in zip(as_float.data, decoded.data, strict=True):
        assert torch.tensor(b.embedding).tolist() == torch.tensor(a.embedding).tolist()
    raw_bytes = base64.b64decode(raw.data[0].embedding)  # type: ignore[arg-type]
    assert list(struct.unpack(f"<{len(raw_bytes) // 4}f", raw_bytes)) == \
        torch.tensor(as_float.data[0].embedding).tolist()
    assert len(cut.data[0].embedding) == 16
    assert_vectors(cut.data[0].embedding, reference(hf_hidden, ids[0], PoolingParams(dimensions=16)))


def test_pooling_route_token_ids_and_mean(server: AsyncLLM, hf_hidden):
    r = post(server, "/pooling", {"input": [PROMPTS[1], PROMPTS[2]], "pooling_type": "MEAN",
                                  "normalize": False, "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == 6
    assert [d["object"] for d in body["data"]] == ["pooling"] * 2
    mean = PoolingParams(pooling_type="MEAN", normalize=False)
    assert_vectors(body["data"][0]["data"], reference(hf_hidden, PROMPTS[1][-5:], mean))
    assert_vectors(body["data"][1]["data"], reference(hf_hidden, PROMPTS[2], mean))


def test_score_and_rerank_are_the_cosine_of_the_embeddings(server: AsyncLLM):
    query, docs = "a fox in the woods", ["a red fox", "stock market news", "the woods at night"]
    embedded = post(server, "/v1/embeddings", {"input": [query, *docs]}).json()["data"]
    vecs = [torch.tensor(d["embedding"]) for d in embedded]
    cosines = [float(torch.dot(vecs[0], v)) for v in vecs[1:]]  # NOTE: unit vectors
    score = post(server, "/score", {"text_1": query, "text_2": docs})
    assert score.status_code == 200, score.text
    data = score.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and data[0]["object"] == "score"
    assert [d["score"] for d in data] == pytest.approx(cosines, abs=1e-5)
    rerank = post(server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert rerank.status_code == 200, rerank.text
    results = rerank.json()["results"]
    order = sorted(range(3), key=lambda i: -cosines[i])[:2]
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [docs[i] for i in order]
    assert [r["relevance_score"] for r in results] == pytest.approx([cosines[i] for i in order], abs=1e-5)
    assert rerank.json()["usage"]["total_tokens"] > 0
    pairs = post(server, "/v1/score", {"text_1": [query, docs[0]], "text_2": [docs[0], docs[0]]})
    assert pairs.json()["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "encoding_format", "float"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions", "at least 1"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 65}, "dimensions", "at most"),
    ("/v1/embeddings", {"input": [[5] * 129]}, "prompt", "maximum context length is 128"),
    ("/v1/embeddings", {"input": [[49152]]}, "prompt", "out of vocabulary"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "max_model_len"),
    ("/v1/embeddings", {"input": "hi", "best_of": 2}, "best_of", "Unsupported"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "1:1, 1:N or N:N"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "empty"),
])
def test_bad_requests(server: AsyncLLM, path: str, body: dict, param: str, words: str):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
