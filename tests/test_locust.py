"""examples/locustfile.py, run headless by Locust for a few seconds against a real server.

The server has an API key, so the locustfile's --api-key is exercised too. Locust writes its
stats as CSV; the run must have no failure, and TTFT, ITL and E2E rows for both endpoints.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server import REPO, ServerProcess, start_server  # noqa: E402

# NOTE: never import locust here: it monkey-patches the standard library (gevent) on import.
if importlib.util.find_spec("locust") is None:
    pytest.skip("Locust comes with pagoda's bench and dev extras", allow_module_level=True)
KEY = "locust-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: Path) -> Iterator[ServerProcess]:
    srv = start_server(tiny_llama, "--dtype", "float32", "--num-kv-blocks", "128",
                       "--api-key", KEY)
    yield srv
    srv.stop()


def test_locustfile_runs_headless_without_failures(keyed_server: ServerProcess,
                                                   tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "examples" / "locustfile.py"),
           "--headless", "--users", "4", "--spawn-rate", "4", "--run-time", "4s",
           "--stop-timeout", "10", "--host", keyed_server.base_url, "--only-summary",
           "--csv", str(prefix), "--max-tokens", "12", "--ignore-eos", "--think-time", "0.05",
           "--api-key", KEY]
    env = {**os.environ, "PAGODA_API_KEY": "", "OPENAI_API_KEY": ""}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, rows
    for key in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                ("TTFT", "chat"), ("TTFT", "completions"), ("ITL", "chat"),
                ("ITL", "completions"), ("E2E", "chat"), ("E2E", "completions")]:
        assert key in rows, f"no {key} row: {sorted(rows)}"
        assert int(rows[key]["Request Count"]) > 0 and int(rows[key]["Failure Count"]) == 0
    # one TTFT per reply and one E2E per finished reply (the 4 users' replies in flight at the
    # end are cut); at most 11 gaps between a reply's 12 tokens
    chats = int(rows[("TTFT", "chat")]["Request Count"])
    assert chats - 4 <= int(rows[("E2E", "chat")]["Request Count"]) <= chats
    assert 0 < int(rows[("ITL", "chat")]["Request Count"]) <= 11 * chats
