"""`pagoda bench serve` and `bench sweep` against a real pagoda server on a tiny model.

One server process per module (`python -m pagoda.entrypoints.openai.api_server`, 256 MiB of
KV). The tests check that the numbers are consistent (tokens counted equal the server's
usage and the requested lengths, percentiles are ordered, failures are counted and kept),
never how fast anything is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagoda.bench.cli import add_bench_parser, run_command
from pagoda.bench.datasets import SampleRequest, length_range, load_tokenizer, random_requests
from pagoda.bench.serving import LoadSettings, arrival_offsets, run_benchmark

REPO = Path(__file__).resolve().parents[1]
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tiny_llama: Path) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--model",
           str(tiny_llama), "--port", str(port), "--kv-cache-memory", "256MiB",
           "--uvicorn-log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tempfile.NamedTemporaryFile(prefix="pagoda_bench_server_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, Path(log.name))
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server did not start:\n{log.read_text()}")


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def assert_percentiles_ordered(result: dict, percentiles: list[str]) -> None:
    for key in LATENCY_KEYS:
        values = [result[f"median_{key}_ms"]] + [result[f"p{p}_{key}_ms"] for p in percentiles]
        assert all(v > 0 for v in values), key
        assert values == sorted(values), (key, values)


def test_serve_counts_match_usage_and_lengths(server_url: str, tiny_llama: Path,
                                              tmp_path: Path) -> None:
    args = bench_args("serve", "--base-url", server_url, "--num-prompts", "8",
                      "--random-input-len", "24", "--random-output-len", "12",
                      "--random-range-ratio", "0.5", "--max-concurrency", "4", "--ignore-eos",
                      "--num-warmups", "2", "--metric-percentiles", "90,99", "--disable-tqdm",
                      "--save-result", "--result-dir", str(tmp_path),
                      "--result-filename", "serve.json")
    result = run_command(args)
    expected = random_requests(load_tokenizer(str(tiny_llama)), 8, length_range(24, 0.5),
                               length_range(12, 0.5), seed=0)
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["errors"] == [""] * 8
    # usage from the server == the local tokenizer's count == what was asked for
    assert result["input_lens"] == [r.prompt_len for r in expected]
    assert result["output_lens"] == [r.expected_output_len for r in expected]
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in expected)
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"])
    assert 1 <= result["max_concurrent_requests"] <= 4
    assert_percentiles_ordered(result, ["90", "99"])
    for ttft, itl, latency, n in zip(result["ttfts"], result["itls"], result["latencies"],
                                     result["output_lens"], strict=True):
        assert 0 < ttft <= latency
        assert ttft + sum(itl) <= latency + 1e-6
        assert len(itl) + 1 <= n  # at most one streamed chunk per token
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["p99_itl_ms"] == result["p99_itl_ms"]
    assert saved["mean_ttft_ms"] == result["mean_ttft_ms"]
    # a saved result is a summary; per-request arrays only with --save-detailed (as vLLM)
    assert not {"ttfts", "itls", "generated_texts", "errors"} & set(saved)
    assert saved["error_samples"] == [] and saved["preset"] is None


def test_serve_chat_endpoint_with_request_rate(server_url: str) -> None:
    args = bench_args("serve", "--base-url", server_url, "--backend", "openai-chat",
                      "--num-prompts", "4", "--random-input-len", "16",
                      "--random-output-len", "6", "--request-rate", "20", "--ignore-eos",
                      "--disable-tqdm")
    result = run_command(args)
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["output_lens"] == [6] * 4
    assert result["api_url"].endswith("/v1/chat/completions")
    # the chat template adds tokens around the 16-token prompt; usage counts them
    assert all(n > 16 for n in result["input_lens"])


def test_failed_requests_are_counted_not_dropped(server_url: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Hello there", "output_len": 4},
            {"prompt": "This asks for far too many tokens", "output_len": 100_000},
            {"prompt": "General Kenobi", "output_len": 5}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    args = bench_args("serve", "--base-url", server_url, "--dataset-name", "custom",
                      "--dataset-path", str(prompts), "--num-prompts", "3", "--ignore-eos",
                      "--disable-tqdm", "--save-detailed", "--result-filename",
                      str(tmp_path / "detailed.json"))
    result = run_command(args)
    detailed = json.loads((tmp_path / "detailed.json").read_text())
    assert detailed["errors"] == result["errors"] and len(detailed["itls"]) == 3
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["errors"][0] == "" and result["errors"][2] == ""
    assert "400" in result["errors"][1]
    assert result["output_lens"] == [4, 0, 5]
    assert result["total_output_tokens"] == 9
    assert len(result["ttfts"]) == 3


def test_rejected_test_request_fails_fast(server_url: str, tiny_llama: Path) -> None:
    args = bench_args("serve", "--base-url", server_url, "--model", "no-such-model",
                      "--tokenizer", str(tiny_llama), "--num-prompts", "2", "--random-input-len", "8",
                      "--random-output-len", "4", "--disable-tqdm")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Initial test run failed.*HTTP 404"):
        run_command(args)
    assert time.monotonic() - start < 30  # not retried until --ready-check-timeout-sec


def test_unreachable_server_fails_every_request() -> None:
    settings = LoadSettings(api_url=f"http://127.0.0.1:{_free_port()}/v1/completions",
                            model="m", ready_check_timeout_s=0, disable_tqdm=True)
    requests = [SampleRequest("hi", 1, 4) for _ in range(3)]
    outputs, _ = asyncio.run(run_benchmark(settings, requests))
    assert [o.success for o in outputs] == [False] * 3
    assert all(o.error for o in outputs)


def test_arrival_offsets_are_seeded_poisson() -> None:
    a = arrival_offsets(50, 10.0, 1.0, seed=1)
    assert a == arrival_offsets(50, 10.0, 1.0, seed=1)
    assert a != arrival_offsets(50, 10.0, 1.0, seed=2)
    assert a == sorted(a) and a[-1] == pytest.approx(5.0)
    assert arrival_offsets(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_sweep_writes_csv_json_png_and_names_the_sweet_spot(server_url: str,
                                                            tmp_path: Path) -> None:
    args = bench_args("sweep", "--base-url", server_url, "--concurrencies", "1,2",
                      "--num-prompts", "4", "--random-input-len", "16",
                      "--random-output-len", "8", "--ignore-eos", "--disable-tqdm",
                      "--slo-metric", "itl", "--slo-ms", "60000", "--price-per-hour", "1.0",
                      "--result-dir", str(tmp_path))
    summary = run_command(args)
    rows = summary["points"]
    assert [r["max_concurrency"] for r in rows] == [1, 2]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in rows)
    best = max(rows, key=lambda r: r["output_throughput"])
    assert summary["sweet_spot"] == best
    assert summary["recommended_max_num_seqs"] == best["max_concurrency"]
    assert all(r["cost_per_million_output_tokens"] > 0 for r in rows)
    for name in ("sweep.csv", "sweep.json", "sweep.png", "point-max_concurrency-1.json"):
        assert (tmp_path / name).stat().st_size > 0
    point = json.loads((tmp_path / "point-max_concurrency-2.json").read_text())
    assert point["completed"] == 4 and "itls" not in point
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3


def test_sweep_with_a_preset_and_no_slo_names_the_knee(server_url: str, tmp_path: Path) -> None:
    # the rag preset, scaled down to the tiny model's 512-token context
    args = bench_args("sweep", "--base-url", server_url, "--preset", "rag",
                      "--concurrencies", "1,2", "--num-prompts", "4",
                      "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
                      "--prefix-repetition-output-len", "6", "--disable-tqdm",
                      "--price-per-hour", "1.0", "--api-price-per-mtok", "10",
                      "--result-dir", str(tmp_path))
    summary = run_command(args)
    assert summary["preset"] == "rag" and summary["slo_metric"] == "ttft"
    assert summary["sweet_spot_rule"] == "knee" and summary["sweet_spot"] is summary["knee"]
    assert summary["sweet_spot"]["max_concurrency"] in (1, 2)
    assert all(r["completed"] == 4 for r in summary["points"])
    # the preset's ignore_eos: every reply has exactly the 6 tokens asked for
    point = json.loads((tmp_path / "point-max_concurrency-1.json").read_text())
    assert point["total_output_tokens"] == 4 * 6 and point["preset"] == "rag"
    assert summary["break_even"]["break_even_tokens_per_month"] == pytest.approx(730 / 10 * 1e6)
