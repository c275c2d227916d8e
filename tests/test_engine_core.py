"""The engine core behind its typed boundary (issue 24): token ids in, token ids out, no text;
the frontend's stop strings end the core's sequence before the next step."""

from __future__ import annotations

import time

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine_core import EngineCore
from pagoda.executor import build_engine_parts
from pagoda.input_processor import EngineRequest
from pagoda.request import RequestStatus

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2042, 905, 88, 3001]
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)


def test_the_core_returns_token_ids_and_finish_reasons_equal_to_the_engine(tiny_llama):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=2, logprobs=1)
    expected = LLM(str(tiny_llama), **ENGINE).generate([PROMPT], params, use_tqdm=False)[0]
    parts = build_engine_parts(EngineConfig.from_kwargs(str(tiny_llama), **ENGINE))
    core = EngineCore(parts, parts.eos_token_ids)
    metrics = core.add_request(EngineRequest("r", PROMPT, params, time.time()))
    assert len(metrics) == 2
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.request_id == "r" and not hasattr(out, "text")
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            tokens[out.sample_index] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.sample_index] = out.finish_reason
    assert [tokens[i] for i in (0, 1)] == [o.token_ids for o in expected.outputs]
    assert finished == {0: RequestStatus.FINISHED_LENGTH, 1: RequestStatus.FINISHED_LENGTH}
    core.check_integrity()
    assert core.abort_request("r") == [] and core.step().outputs == []
    core.shutdown()


def test_a_stop_string_frees_the_sequence_before_the_next_step(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = llm.tokenizer.decode(free.token_ids[3:5])
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop=[stop]))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == stop
    assert not engine.core.has_unfinished_requests() and not engine.scheduler.running
    engine.check_integrity()


def test_partial_prefills_change_the_order_not_the_tokens(tiny_llama, caplog):
    """vLLM's --max-num-partial-prefills 2 with a long prompt (above 8 tokens) among short
    ones: vLLM's start-up line names the settings, and every greedy answer equals the default
    engine's (the scheduler changes when a prompt runs, never what it computes)."""
    import logging

    prompts = [list(range(5, 45)), list(range(50, 90)), [7, 8, 9], [11, 12], list(range(100, 140))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    default = LLM(str(tiny_llama), max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in default.generate(prompts, params)]
    with caplog.at_level(logging.INFO, logger="pagoda"):
        partial = LLM(str(tiny_llama), max_num_batched_tokens=16, max_num_partial_prefills=2,
                      long_prefill_token_threshold=8)
    assert ("Concurrent partial prefills enabled with max_num_partial_prefills=2, "
            "max_long_partial_prefills=1, long_prefill_token_threshold=8") in caplog.text
    assert [o.outputs[0].token_ids for o in partial.generate(prompts, params)] == expected
