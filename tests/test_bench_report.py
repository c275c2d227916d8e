"""vLLM's serving metrics on hand-made request outputs."""

from __future__ import annotations

import pytest

from pagoda.bench.endpoints import RequestFuncOutput, chunk_text
from pagoda.bench.report import PER_REQUEST_KEYS, calculate_metrics, format_result_block, summarize


def ok(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10
       ) -> RequestFuncOutput:
    latency = ttft + sum(itl)
    return RequestFuncOutput(success=True, generated_text="x" * (len(itl) + 1), prompt_len=prompt,
                             output_tokens=tokens, usage_prompt_tokens=prompt, ttft=ttft,
                             itl=itl, latency=latency, start_time=start)


OUTPUTS = [
    ok(0.0, 0.2, [0.1, 0.1, 0.1], tokens=4),
    ok(0.3, 0.4, [0.2, 0.2], tokens=3, prompt=20),
    RequestFuncOutput(success=False, prompt_len=30, start_time=0.6, latency=0.1,
                      error="RuntimeError: HTTP 400: too long"),
]


def test_metrics_follow_vllm_definitions() -> None:
    r = calculate_metrics(OUTPUTS, duration_s=2.0, percentiles=[50, 99])
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["errors"] == ["", "", "RuntimeError: HTTP 400: too long"]
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 7)
    assert r["output_lens"] == [4, 3, 0]
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(18.5)
    assert r["mean_ttft_ms"] == pytest.approx(300.0)
    # TPOT = (latency - ttft) / (tokens - 1): 0.3 / 3 and 0.4 / 2
    assert r["mean_tpot_ms"] == pytest.approx(150.0)
    # ITL pools every gap: 0.1 x3 and 0.2 x2
    assert r["mean_itl_ms"] == pytest.approx(140.0)
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["p99_itl_ms"] == pytest.approx(200.0, rel=1e-3)
    assert r["mean_e2el_ms"] == pytest.approx(650.0)
    assert r["max_concurrent_requests"] == 2  # [0, 0.5) and [0.3, 1.1) overlap
    assert r["request_goodput"] is None


def test_goodput_counts_requests_within_every_slo() -> None:
    r = calculate_metrics(OUTPUTS, 2.0, [99], goodput_slos_ms={"ttft": 300, "tpot": 150})
    assert r["request_goodput"] == pytest.approx(0.5)  # only the first request


def test_outputs_without_usage_are_counted_by_the_tokenizer() -> None:
    out = ok(0.0, 0.1, [0.1], tokens=2)
    out.output_tokens = None
    out.generated_text = "one two three"
    r = calculate_metrics([out], 1.0, count_tokens=lambda text: len(text.split()))
    assert r["output_lens"] == [3]


def test_result_block_has_vllms_lines() -> None:
    r = calculate_metrics(OUTPUTS, 2.0, [99])
    block = format_result_block(r, max_concurrency=4, request_rate=float("inf"),
                                metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[99])
    lines = block.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == f"{'Successful requests:':<40} {'2':<10}"
    assert "Failed requests:                         1" in block
    assert "Maximum request concurrency:             4" in block
    assert "Request rate configured" not in block
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
        assert label in block
    assert "---------------Time to First Token----------------" in lines
    assert lines[-1] == "=" * 50


def test_chunk_text_of_completions_and_chat() -> None:
    assert chunk_text({"choices": [{"text": "hi"}]}, chat=False) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                      chat=True) == ""
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}, chat=True) == "yo"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) is None


def test_summary_drops_per_request_arrays_and_keeps_distinct_errors() -> None:
    outputs = [*OUTPUTS, RequestFuncOutput(success=False, prompt_len=5, start_time=0.7,
                                           latency=0.1, error="RuntimeError: HTTP 400: too long")]
    result = calculate_metrics(outputs, duration_s=2.0, percentiles=[99])
    summary = summarize(result)
    assert not set(PER_REQUEST_KEYS) & set(summary)
    assert summary["error_samples"] == ["RuntimeError: HTTP 400: too long"]
    assert summary["p99_itl_ms"] == result["p99_itl_ms"] and summary["failed"] == 2
    assert set(result) - set(summary) == set(PER_REQUEST_KEYS)
