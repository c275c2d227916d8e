"""`pagoda bench soak`: a short real run against the tiny model, and its verdict rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server import free_port

from pagoda.bench.cli import main
from pagoda.bench.soak import parse_duration, verdict


def line(ok: int = 5, failures: int = 0, held: int = 0, rss: float = 800.0,
         kv: float = 100.0) -> dict:
    return {"ok": ok, "num_failures": failures, "failures": ["x"] * failures,
            "kv_blocks_held_idle": held, "rss_mb": rss, "kv_touched_mb": kv}


def test_verdict_rules():
    assert verdict([line(), line(rss=850.0)], 0.10) == []
    assert "failed requests" in verdict([line(), line(failures=2)], 0.10)[0]
    assert "held while idle" in verdict([line(held=3)], 0.10)[0]
    assert "RSS rose from 800.0 MB to 900.0 MB" in verdict([line(), line(rss=900.0)], 0.10)[0]
    assert verdict([line(), line(rss=1300.0, kv=600.0)], 0.10) == []  # the KV pool filling
    assert parse_duration("10m") == 600 and parse_duration("2h") == 7200
    assert parse_duration("90") == 90


def test_short_soak_passes_on_the_tiny_model(tiny_llama: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "soak.json"
    main(["soak", "--model", str(tiny_llama), "--duration", "6s", "--interval", "2s",
          "--concurrency", "4", "--max-tokens", "8", "--port", str(free_port()),
          "--output-json", str(out), "--max-rss-growth", "0.5", "--hostile-ratio", "0.15",
          "--server-arg=--dtype=float32", "--server-arg=--max-model-len=256"])
    result = json.loads(out.read_text())
    assert result["passed"] and result["problems"] == []
    lines = result["intervals"]
    assert len(lines) >= 3
    assert sum(x["ok"] for x in lines) > 10
    assert sum(x["aborted"] for x in lines) > 0 and sum(x["refused"] for x in lines) > 0
    assert sum(x["hostile"] for x in lines) > 0  # grammars, big choices, many prompts: answered
    assert all(isinstance(x["probe_ttft_s"], float) and 0 < x["probe_ttft_s"] < 60 for x in lines)
    assert all(x["kv_blocks_held_idle"] == 0 and x["rss_mb"] > 0 for x in lines)
    assert "soak PASSED" in capsys.readouterr().out
