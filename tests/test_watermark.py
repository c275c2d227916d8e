"""vLLM's Gumbel-max watermark (`--watermark-config`): the PRF's bits, sampling, the context
history, detection, and the request path (engine, workers' copies, metrics, flags)."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry
from test_server import metric, start_server
from test_server_api import serve_parser

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig, LimitsConfig, WatermarkConfig
from pagoda.input_processor import InputProcessor
from pagoda.layers import cpu_kernels
from pagoda.metrics import PrometheusStatLogger
from pagoda.request import Request
from pagoda.sampler import Sampler
from pagoda.scheduler import SchedulerOutput
from pagoda.server.protocol import CompletionRequest
from pagoda.server.serve import engine_kwargs, vllm_spelling
from pagoda.stats import FinishedRequestStats, IterationStats
from pagoda.watermark import (
    ContextHistory,
    WatermarkDetector,
    Watermarker,
    gamma_survival,
    philox4x32_10,
    philox_uniform,
    token_uniforms,
)
from pagoda.worker_step import for_workers

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30]


def _words(*values: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


@pytest.mark.parametrize(("counter", "key", "expected"), [
    # NOTE: Random123's known-answer vectors for Philox4x32-10 (kat_vectors)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    out = philox4x32_10(_words(*counter), _words(*key))  # type: ignore[arg-type]
    assert tuple(int(w) for w in out) == expected


def test_uniforms_equal_vllms_prf():
    """Computed by vLLM 0.32.0's `vllm.v1.watermarking.prfs.philox._philox_uniform` (key
    2^40 + 12345), as the 24-bit integers behind each uniform ((m + 1) / (2^24 + 1))."""
    vllm = [[16454132, 5497433, 15496509, 13620690, 7399203, 6542036],
            [1725759, 69249, 6627483, 5221368, 15738345, 2727521],
            [14094084, 14602556, 3556136, 8895182, 4240520, 120088],
            [12238671, 2325104, 4025221, 1268870, 7020038, 1595642]]
    key = (1 << 40) + 12345
    contexts = torch.tensor([[-1, -1, -1, -1], [-1, -1, 5, 7], [1, 2, 3, 4], [49151, 0, 17, 3]])
    tokens = [0, 1, 2, 3, 1000, 49151]
    whole = philox_uniform(key, contexts, 49152)[:, tokens]
    expected = (torch.tensor(vllm, dtype=torch.float64) + 1) / (2**24 + 1)
    assert torch.equal(whole, expected.float())
    pairs = token_uniforms(key, contexts.repeat_interleave(len(tokens), 0), torch.tensor(tokens * 4))
    assert torch.equal(pairs, whole.flatten())


@pytest.mark.parametrize("variant", ["kernels", "torch"])
def test_watermarked_tokens_are_the_argmax_of_logits_plus_noise(variant, monkeypatch):
    """The kernels' uniforms are torch's bits; the token is argmax(logits + noise) over the
    tokens top-k left (vLLM's `GumbelWatermarker`)."""
    g = torch.Generator().manual_seed(1)
    contexts = torch.randint(-1, 5001, (6, 3), generator=g)
    reference = philox_uniform(7, contexts, 5001)
    if variant == "torch":
        monkeypatch.setattr("pagoda.layers.cpu_kernels.takes", lambda x: False)
    else:
        assert torch.equal(cpu_kernels.ops.philox_uniform(7, contexts, 5001), reference)
    logits = torch.randn(6, 5001, generator=g) * 3
    logits[2, 100:] = float("-inf")
    noise = -reference.log().neg().log()
    marker = Watermarker(WatermarkConfig(key=7, context_width=3))
    got = marker.sample(logits, [tuple(c) for c in contexts.tolist()], [None] * 6)
    assert got == (logits + noise).argmax(dim=-1).tolist()
    assert got[2] < 100


def test_watermarked_sampling_follows_the_distribution():
    """Over many contexts the watermarked choice is a sample of softmax(logits): a token of
    probability p is picked in about p of them."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * 12])
    contexts = [(i, i // 7, 3) for i in range(4000)]
    marker = Watermarker(WatermarkConfig(key=11, context_width=3))
    picks = torch.tensor(marker.sample(logits.expand(len(contexts), -1), contexts, [None] * len(contexts)))
    freq = torch.bincount(picks, minlength=4)[:4].float() / len(contexts)
    assert torch.allclose(freq, logits[0, :4].softmax(-1), atol=0.03)


def _reference_repeated(history: list[int], context: tuple[int, ...], max_history: int | None) -> bool:
    """vLLM's `_repeated_context_mask_cpu`, written plainly: is `context` the context before
    some searched history position?"""
    width = len(context)
    prefix = [-1] * width
    start = 0 if max_history is None else max(0, len(history) - max_history)
    for position, token in enumerate(history):
        if position >= start and tuple(prefix[-width:]) == context:
            return True
        prefix.append(token)
    return False


@pytest.mark.parametrize("scope", ["none", "single_turn", "all"])
@pytest.mark.parametrize("max_history", [None, 5])
def test_context_history_matches_vllms_search(scope, max_history):
    g = torch.Generator().manual_seed(3)
    config = WatermarkConfig(key=1, context_width=2, deduplicate_contexts=scope,
                             deduplicate_contexts_max_history=max_history)
    request = Request("r", [4, 5, 4, 5, 6], SamplingParams(max_tokens=80))
    history = ContextHistory(config)
    kinds = set()
    for _ in range(60):
        got = history.next_context(request)
        out = request.output_token_ids
        context = tuple(([-1, -1] + out)[-2:])
        if scope == "none":
            expected: tuple[int, ...] | None = context
        elif scope == "all" and len(out) < 2:
            expected = None
        else:
            searched = request.all_token_ids if scope == "all" else out
            expected = None if _reference_repeated(searched, context, max_history) else context
        assert got == expected
        kinds.add(got is None)
        token = int(torch.randint(4, 8, (1,), generator=g))
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
    assert kinds == ({False} if scope == "none" else {True, False})


def test_gamma_survival_equals_the_regularized_gamma():
    for score, shape in ((3.0, 1), (10.0, 9), (120.0, 100), (400.0, 200)):
        expected = float(torch.special.gammaincc(torch.tensor(float(shape), dtype=torch.float64),
                                                 torch.tensor(score, dtype=torch.float64)))
        assert math.isclose(gamma_survival(score, shape), expected, rel_tol=1e-8)


def test_detector_scores_as_vllms():
    """Score and p-value of vLLM 0.32.0's GumbelWatermarkDetector(7, context_width=2) and
    DualKeyGumbelWatermarkDetector(7, context_width=2, alpha=0.3) on these ids (repeated
    contexts not scored: 9 of 16)."""
    ids = [5, 17, 900, 5, 17, 900, 5, 17, 3, 4, 4, 4, 4, 4, 12, 13]
    single = WatermarkDetector(WatermarkConfig(key=7, context_width=2)).detect(ids)
    assert (single.num_scored_tokens, single.is_watermarked) == (9, False)
    assert math.isclose(single.score, 7.834433278904429, rel_tol=1e-12)
    assert math.isclose(single.p_value, 0.6156448960817644, rel_tol=1e-9)
    dual = WatermarkDetector(WatermarkConfig(key=7, context_width=2, algorithm="dual_key_gumbel",
                                             alpha=0.3)).detect(ids)
    assert math.isclose(dual.score, 10.191951125207247, rel_tol=1e-12)
    assert math.isclose(dual.p_value, 0.27955718908638283, rel_tol=1e-9)


@pytest.fixture(scope="module")
def marked_llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256,
               watermark_config={"key": 42})


@pytest.mark.parametrize("algorithm", ["gumbel", "dual_key_gumbel"])
def test_generated_text_is_detected_with_the_key_only(tiny_llama, marked_llm, algorithm):
    llm = marked_llm if algorithm == "gumbel" else LLM(
        str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256,
        watermark_config={"key": 42, "algorithm": algorithm})
    config = WatermarkConfig(key=42, algorithm=algorithm)
    prompts = [PROMPT, PROMPT[:5], [1, 9, 99, 999]]
    marked = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=5), use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=5, watermarking=False),
        use_tqdm=False)]
    detector = WatermarkDetector(config)
    wrong_key = WatermarkDetector(WatermarkConfig(key=43, algorithm=algorithm))
    assert all(detector.detect(ids).p_value < 1e-6 for ids in marked)
    assert all(wrong_key.detect(ids).p_value > 1e-3 for ids in marked)
    assert all(detector.detect(ids).p_value > 1e-3 for ids in plain)


def test_greedy_and_opted_out_requests_sample_as_without_a_watermark(tiny_llama, marked_llm):
    unmarked = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256)
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3,
                                  watermarking=False)):
        a = marked_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        b = unmarked.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        assert a == b
    seeded = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3)
    a = marked_llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    b = unmarked.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert a != b


def test_workers_copies_sample_the_same_watermarked_tokens():
    """A TP/PP worker gets each request's context computed in the engine (its copy holds only
    the step's tokens): its sampler picks what the engine's own sampler picks."""
    config = WatermarkConfig(key=5, context_width=2)
    requests = []
    for i in range(4):
        r = Request(f"r{i}", PROMPT, SamplingParams(temperature=1.0, max_tokens=20), watermark=ContextHistory(config))
        r.output_token_ids += [3, 4, 3, 4, 3][:i + 1]
        r.all_token_ids += [3, 4, 3, 4, 3][:i + 1]
        r.num_computed_tokens = r.num_tokens - 1
        requests.append(r)
    out = SchedulerOutput()
    for r in requests:
        out.add(r, 1)
    copies = for_workers(out, 64).requests
    assert [c.watermark_context for c in copies] == [r.watermark_context for r in requests]
    assert copies[3].watermark_context is None  # NOTE: (3, 4) came before: sampled unwatermarked
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(Watermarker(config))
    marked = [0, 1, 2]
    assert ([sampler(logits.clone(), copies).token_ids[i] for i in marked]
            == [sampler(logits.clone(), requests).token_ids[i] for i in marked])


def test_requests_resolve_watermarking_as_vllm():
    processor = InputProcessor(None, 100, 64, LimitsConfig().resolved(8, 64), watermark=WatermarkConfig(key=1))
    resolved = [processor.check_params(SamplingParams(**kw)) for kw in (
        {}, {"temperature": 0}, {"watermarking": False}, {"watermarking": True, "temperature": 0.5})]
    assert [(p.watermarking, p.watermark_status) for p in resolved] == [
        (True, "watermarked"), (False, "skipped"), (False, "not_watermarked"), (True, "watermarked")]
    unconfigured = InputProcessor(None, 100, 64, LimitsConfig().resolved(8, 64))
    asked = unconfigured.check_params(SamplingParams(watermarking=True))
    assert (asked.watermarking, asked.watermark_status) == (False, None)


def test_watermark_requests_metric_by_status():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", EngineConfig(watermark=WatermarkConfig(key=1)), registry=registry)
    base = dict(finish_reason="length", num_prompt_tokens=3, num_generation_tokens=2, max_tokens_param=2,
                e2e_latency=1.0, queue_time=0.1, prefill_time=0.2, decode_time=0.5, inference_time=0.7,
                mean_time_per_output_token=0.5)
    stats = IterationStats(finished_requests=[FinishedRequestStats(**base, watermark_status=s)  # type: ignore[arg-type]
                                              for s in ("watermarked", "watermarked", "skipped")])
    logger.record(None, stats)
    count = {s: registry.get_sample_value("vllm:watermark_requests_total",
                                          {"model_name": "m", "engine": "0", "status": s})
             for s in ("watermarked", "skipped", "not_watermarked")}
    assert count == {"watermarked": 2.0, "skipped": 1.0, "not_watermarked": 0.0}
    plain = CollectorRegistry()
    PrometheusStatLogger("m", EngineConfig(), registry=plain)
    assert plain.get_sample_value("vllm:watermark_requests_total",
                                  {"model_name": "m", "engine": "0", "status": "watermarked"}) is None


def test_flags_and_request_field():
    for argv in (["--watermark-config", '{"algorithm": "gumbel", "key": 42}'],
                 ["--watermark-config.algorithm", "gumbel", "--watermark-config.key", "42"]):
        args = serve_parser().parse_args(vllm_spelling(["serve", "m", *argv]))
        config = EngineConfig.from_kwargs("m", **engine_kwargs(args))
        assert config.watermark == WatermarkConfig(key=42)
    assert "watermarking" not in CompletionRequest(prompt="x").sampling_kwargs()
    assert CompletionRequest(prompt="x", watermarking=False).sampling_kwargs()["watermarking"] is False


@pytest.mark.parametrize(("value", "message"), [
    ('{"algorithm": "gumbel"}', "needs 'key'"),
    ('{"key": 42, "algorithm": "kgw"}', "algorithm"),
    ('{"key": 42, "context_width": 0}', "context_width"),
    ('{"key": 42, "deduplicate_contexts": "some"}', "deduplicate_contexts"),
    ('{"key": 42, "colour": 1}', "Unknown watermark_config key"),
    ('{"key": 123456789, ', "must be JSON"),
    ('{"key": -5}', "key must be an integer"),
])
def test_bad_configs_refused_without_echoing_the_key(value, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineConfig.from_kwargs("m", watermark_config=value)
    assert "123456789" not in str(e.value) and "-5" not in str(e.value)
    assert "key=" not in repr(WatermarkConfig(key=987654321)) and "987654321" not in repr(WatermarkConfig(key=987654321))


def test_speculative_decoding_with_a_watermark_refused():
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig.from_kwargs("m", watermark_config={"key": 1},
                                 speculative_config={"method": "ngram"})


def test_tensor_parallel_workers_watermark_as_one_process(tiny_llama, marked_llm):
    """Under TP the workers sample: each request's context travels with its copy, and the
    tokens are one process's."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)
    prompts = [PROMPT, [1, 9, 99, 999]]
    want = [o.outputs[0].token_ids for o in marked_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256,
              watermark_config={"key": 42}, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.engine.shutdown()
    detector = WatermarkDetector(WatermarkConfig(key=42))
    assert all(detector.detect(ids).is_watermarked for ids in want)


def test_server_watermarks_counts_and_hides_the_key(tiny_llama):
    """`--watermark-config` (dotted, as a launch script may spell it) on a live server: a sampled
    answer carries the watermark, `watermarking: false` and greedy ones do not, the metric
    counts each, and the key appears nowhere in the log."""
    import httpx

    server = start_server(tiny_llama, "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
                          "--watermark-config.key", "918273645", "--watermark-config.context_width", "3")
    try:
        def complete(**fields: object) -> list[int]:
            body = {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "return_token_ids": True, **fields}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        detector = WatermarkDetector(WatermarkConfig(key=918273645, context_width=3))
        assert detector.detect(complete(temperature=1.0, seed=1)).is_watermarked
        assert not detector.detect(complete(temperature=1.0, seed=1, watermarking=False)).is_watermarked
        complete(temperature=0)
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        counts = [metric(text, "vllm:watermark_requests_total", status=s)
                  for s in ("watermarked", "not_watermarked", "skipped")]
        assert counts == [1.0, 1.0, 1.0]
    finally:
        server.stop()
    log = server.log()
    assert "Watermark: gumbel, context width 3" in log and "918273645" not in log
