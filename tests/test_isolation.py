"""One request never hurts another, in the engine (issue: reliability).

Each hostile or failing request runs in the same batch as innocent ones, which must still get
exactly the output they get alone: refused inputs (huge n, out-of-vocabulary stop ids, top_k
overflow, 64-bit seeds), a model step that fails for one request (found by rerunning the
batch a request at a time, seeded generators restored), a reader of KV its failed writer
never wrote (preempted and recomputed), a detokenizer error, a broken stat logger. Also
vLLM's `min_tokens` semantics and typed request identity.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine import LLMEngine
from pagoda.llm import merge_delta
from pagoda.metrics.base import StatLoggerBase
from pagoda.outputs import RequestOutput

PROMPTS = {
    "a": [1, 504, 3575, 282, 4649, 314, 7042, 30, 2042, 905, 88, 3001],
    "b": [1, 9, 800, 1200, 77, 65, 43],
    "c": [1, 3000, 3001, 3002],
}
SHARED = [1] + list(range(200, 239))  # 40 tokens: two full blocks of 16 can be shared


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=256)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def seeded(seed: int = 7) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=40, seed=seed, max_tokens=12, ignore_eos=True)


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
    engine.check_integrity()
    return results


def alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def innocents(llm: LLM) -> dict[str, tuple[list[int], SamplingParams, list[int]]]:
    """id -> (prompt, params, the tokens it gets alone)."""
    cases = {"a": (PROMPTS["a"], greedy()), "b": (PROMPTS["b"], seeded()),
             "c": (PROMPTS["c"], greedy(max_tokens=6))}
    return {k: (p, sp, alone(llm, p, sp)) for k, (p, sp) in cases.items()}


def add_innocents(engine: LLMEngine, cases: dict) -> None:
    for rid, (prompt, params, _) in cases.items():
        engine.add_request(rid, prompt, params)


def assert_innocents_exact(results: dict[str, RequestOutput], cases: dict) -> None:
    for rid, (_, _, expected) in cases.items():
        out = results[rid]
        assert out.error is None, (rid, out.error)
        assert out.outputs[0].token_ids == expected, rid


# ---- refused inputs --------------------------------------------------------------------------
@pytest.mark.parametrize("params, param, message", [
    (dict(n=9223372036854775808, temperature=1.0), "n", "n must be at most 256"),
    (dict(n=1_000_000, temperature=1.0), "n", "--max-n"),
    (dict(stop_token_ids=[999_999_999], min_tokens=1), "stop_token_ids", "out of vocabulary"),
    (dict(stop=["x"] * 65), "stop", "at most 64"),
    (dict(stop=["y" * 1025]), "stop", "at most 1024 characters"),
    (dict(seed=2**64), "seed", "integer in [-9223372036854775808, 9223372036854775807]"),
])
def test_bad_params_are_refused_and_the_batch_runs_on(llm: LLM, params: dict, param: str,
                                                      message: str):
    cases = innocents(llm)
    engine = llm.engine
    add_innocents(engine, cases)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as info:
        engine.add_request("bad", "Once upon a time", SamplingParams(max_tokens=16, **params))
    assert getattr(info.value, "param", None) == param
    assert_innocents_exact(run(engine), cases)


@pytest.mark.parametrize("top_k", [9223372036854775808, 10**30, 49152, 10**6])
def test_top_k_beyond_the_vocabulary_means_off(llm: LLM, top_k: int):
    cases = innocents(llm)
    engine = llm.engine
    add_innocents(engine, cases)
    params = SamplingParams(temperature=1.0, top_k=top_k, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("big_k", PROMPTS["a"], params)
    results = run(engine)
    assert_innocents_exact(results, cases)
    off = SamplingParams(temperature=1.0, top_k=-1, seed=3, max_tokens=8, ignore_eos=True)
    assert results["big_k"].outputs[0].token_ids == alone(llm, PROMPTS["a"], off)


def test_tiny_temperature_is_greedy(llm: LLM):
    tiny = SamplingParams(temperature=5e-324, max_tokens=16, ignore_eos=True)
    out = llm.generate([PROMPTS["a"]], tiny, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == alone(llm, PROMPTS["a"], greedy(max_tokens=16))
    assert out.text and len(out.token_ids) == 16


def test_extreme_seeds_run(llm: LLM):
    for seed in (2**63 - 1, -(2**63), 0):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)
        assert alone(llm, PROMPTS["c"], params) == alone(llm, PROMPTS["c"], params)


# ---- a failing step --------------------------------------------------------------------------
class FailFor:
    """Wraps `runner.execute`: raises whenever request `culprit` is in the batch, after the
    real call (so the batch's seeded generators have advanced)."""

    def __init__(self, execute: Callable, culprit: str) -> None:
        self.execute, self.culprit, self.calls = execute, culprit, 0

    def __call__(self, out):
        self.calls += 1
        result = self.execute(out)
        if any(r.request_id == self.culprit for r in out.requests):
            raise RuntimeError("injected failure")
        return result


def test_a_failing_request_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    cases = innocents(llm)
    engine = llm.engine
    failer = FailFor(engine.runner.execute, "bad")
    monkeypatch.setattr(engine.runner, "execute", failer)
    add_innocents(engine, cases)
    engine.add_request("bad", PROMPTS["a"], SamplingParams(n=2, temperature=1.0, max_tokens=8))
    results = run(engine)
    assert_innocents_exact(results, cases)
    bad = results["bad"]
    assert bad.error == "RuntimeError: injected failure" and bad.finished
    assert [o.finish_reason for o in bad.outputs] == ["error", "error"]
    assert failer.calls > 1 + len(cases)  # the full batch, then one call per request


def test_reader_of_a_failed_writers_blocks_is_recomputed(llm: LLM,
                                                        monkeypatch: pytest.MonkeyPatch):
    expected = alone(llm, SHARED, greedy())
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    monkeypatch.setattr(engine.runner, "execute", FailFor(engine.runner.execute, "writer"))
    engine.add_request("writer", SHARED, greedy())
    engine.add_request("reader", SHARED, greedy())
    results = run(engine)
    assert results["writer"].error is not None
    reader = results["reader"]
    assert reader.num_cached_tokens == 32, "the reader must have hit the writer's fresh blocks"
    assert reader.metrics.num_preemptions == 1
    assert reader.outputs[0].token_ids == expected


def test_a_detokenizer_error_fails_only_its_request(llm: LLM):
    cases = innocents(llm)
    engine = llm.engine
    add_innocents(engine, cases)
    engine.add_request("bad", PROMPTS["b"], greedy())

    def broken(token_id: int) -> bool:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.states["bad"].samples[0].detok.add_token = broken  # type: ignore[method-assign]
    results = run(engine)
    assert_innocents_exact(results, cases)
    assert results["bad"].error.startswith("UnicodeDecodeError")


class BrokenLogger(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats) -> None:
        raise RuntimeError("sink down")

    def log(self) -> None:
        raise RuntimeError("sink down")


def test_a_broken_stat_logger_is_skipped(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    cases = innocents(llm)
    engine = llm.engine
    monkeypatch.setattr(engine, "stat_loggers", [BrokenLogger()])
    add_innocents(engine, cases)
    assert_innocents_exact(run(engine), cases)


# ---- identity and vLLM semantics ---------------------------------------------------------
def test_request_ids_are_typed(llm: LLM):
    engine = llm.engine
    engine.add_request("a#b", PROMPTS["a"], greedy(max_tokens=4))
    engine.add_request("x", PROMPTS["b"], SamplingParams(n=2, seed=1, max_tokens=4))
    engine.add_request("x#1", PROMPTS["c"], greedy(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", PROMPTS["c"], greedy())
    results = run(engine)
    assert results["a#b"].outputs[0].token_ids == alone(llm, PROMPTS["a"], greedy(max_tokens=4))
    assert [o.index for o in results["x"].outputs] == [0, 1]
    assert results["x#1"].outputs[0].token_ids == alone(llm, PROMPTS["c"], greedy(max_tokens=4))


def test_min_tokens_masks_eos_even_with_ignore_eos(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    first = alone(llm, PROMPTS["a"], greedy())[0]
    monkeypatch.setattr(llm.engine.core, "eos_token_ids", {first})
    out = llm.generate([PROMPTS["a"]], greedy(min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != first  # vLLM: EOS is masked until min_tokens, ignore_eos or not
    free = llm.generate([PROMPTS["a"]], greedy(), use_tqdm=False)[0].outputs[0]
    assert free.token_ids[0] == first and len(free.token_ids) == 12  # ignore_eos runs past it


def test_stop_strings_wait_for_min_tokens(llm: LLM):
    ref = llm.generate([PROMPTS["a"]], greedy(max_tokens=32), use_tqdm=False)[0].outputs[0]
    # the text of the first two tokens; a stop string inside it is ignored before min_tokens
    head = llm.tokenizer.decode(ref.token_ids[:2])
    stop = head.strip()[:2]
    assert stop and stop in ref.text
    early = llm.generate([PROMPTS["a"]], greedy(max_tokens=32, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    late = llm.generate([PROMPTS["a"]], greedy(max_tokens=32, stop=[stop], min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > 4
    assert late.token_ids == ref.token_ids[:len(late.token_ids)]
    if late.finish_reason == "stop":  # a later occurrence ends it, and is cut
        assert late.text.startswith(early.text) and stop not in late.text[len(head):]


def test_a_step_that_fails_for_everyone_stops_the_engine(tiny_llama, monkeypatch: pytest.MonkeyPatch):
    """Issue 24: a step that fails every time (a lost device) was rerun request by request
    forever, failing every request while /health said ok. After three steps in which every
    one of several requests failed alone too, the engine raises a fatal `EngineStuckError`."""
    from pagoda.engine import EngineStuckError

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256)
    engine = llm.engine

    def broken(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for step in range(2):
        engine.add_request(f"a{step}", PROMPTS["a"], greedy())
        engine.add_request(f"b{step}", PROMPTS["b"], greedy())
        outs = {o.request_id: o for o in engine.step()}
        assert all(o.finished and o.error and "device lost" in o.error for o in outs.values())
    engine.add_request("alone", PROMPTS["c"], greedy())
    engine.step()  # NOTE: one request failing alone may be its own fault: the count restarts
    for step in range(2):
        engine.add_request(f"c{step}", PROMPTS["a"], greedy())
        engine.add_request(f"d{step}", PROMPTS["b"], greedy())
        engine.step()
    engine.add_request("e", PROMPTS["a"], greedy())
    engine.add_request("f", PROMPTS["b"], greedy())
    with pytest.raises(EngineStuckError, match="3 steps in a row failed for every request.*device lost"):
        engine.step()


def test_a_fatal_error_is_never_rerun(tiny_llama, monkeypatch: pytest.MonkeyPatch):
    """Issue 24: an error marked `fatal` (a dead parallel worker, a stuck engine) means no
    request can run any more; rerunning the batch a request at a time would only repeat it.
    The step raises it at once, after one call."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    calls = []

    class WorkerDied(RuntimeError):
        fatal = True

    def dead(out):
        calls.append(len(out.requests))
        raise WorkerDied("worker 1 died")

    monkeypatch.setattr(engine.runner, "execute", dead)
    for name, prompt in PROMPTS.items():
        engine.add_request(name, prompt, greedy())
    with pytest.raises(WorkerDied, match="worker 1 died"):
        engine.step()
    assert calls == [len(PROMPTS)]
