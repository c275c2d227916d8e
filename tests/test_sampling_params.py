"""SamplingParams and engine config validation: clear errors naming parameter and value."""

from __future__ import annotations

import pytest

from pagoda.config import CacheConfig, EngineConfig, parse_bytes
from pagoda.sampling_params import RepetitionDetectionParams, SamplingParamError, SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n"),
    (dict(n=2, temperature=0.0), "n"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-3), "prompt_logprobs"),
    (dict(bad_words=["a", ""]), "bad_words"),
])
def test_invalid_values_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    value = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if value is not None and not isinstance(value, list):
        assert str(value) in str(err.value)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=0)
    assert p.stop == ["###"] and p.top_k == -1 and not p.greedy
    child = SamplingParams(n=3, seed=10, temperature=1.0).for_child(2)
    assert child.n == 1 and child.seed == 12


def test_engine_config_errors():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="Unknown engine argument 'blok_size'"):
        EngineConfig.from_kwargs("smollm2", blok_size=16)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig.from_kwargs("smollm2", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig.from_kwargs("smollm2", tensor_parallel_size=3, nnodes=2,
                                 dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="dist_init_addr"):
        EngineConfig.from_kwargs("smollm2", tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_kwargs("smollm2", dtype="int3")
    cfg = EngineConfig.from_kwargs("m", kv_cache_memory="2GiB", max_num_seqs=8, max_model_len=512)
    assert cfg.cache.kv_cache_memory_bytes == 2 * 1024**3 and cfg.scheduler.max_num_seqs == 8
    assert cfg.model.max_model_len == 512


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes(100) == 100
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize("detect, tokens, found", [
    ((4, 0, 3), [1, 2, 3, 1, 2, 3, 1, 2, 3], True),   # 'abc' three times
    ((4, 0, 3), [9, 1, 2, 3, 1, 2, 3, 1, 2], False),  # the tail is not whole repeats
    ((4, 0, 3), [5, 5, 5], True),
    ((4, 2, 3), [5, 5, 5], False),                    # patterns of 2 to 4 tokens only
    ((4, 2, 3), [5, 5, 5, 5, 5, 5], True),
    ((4, 0, 3), [1, 2, 1, 2], False),                 # twice is not three times
    ((0, 0, 0), [1, 1, 1, 1], False),                 # off
])
def test_repetition_detection_finds_a_pattern_repeated_at_the_end(detect, tokens, found):
    """vLLM's check_sequence_repetition, cases by hand (against vLLM's own function on 20,000
    random cases: docs/benchmarks/vllm/request_fields_check.py)."""
    assert RepetitionDetectionParams(*detect).repeats(tokens) is found


@pytest.mark.parametrize("detect, words", [
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
])
def test_repetition_detection_refuses_what_vllm_refuses(detect, words):
    with pytest.raises(SamplingParamError, match=words) as err:
        SamplingParams(repetition_detection=detect)
    assert err.value.param == "repetition_detection"
