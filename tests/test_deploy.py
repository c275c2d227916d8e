"""The deploy kit: alert rules under promtool, the Grafana dashboard, a real Prometheus server
scraping a real pagoda server process (the tiny model, started as test_server.py starts it).

promtool and prometheus come from Debian's `prometheus` package (scripts/install_prometheus.sh,
which .ci/run calls); tests that need them skip, saying so, where they are absent.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from test_server import start_server

from pagoda.config import EngineConfig
from pagoda.metrics import PrometheusStatLogger
from pagoda.stats import FinishedRequestStats, IterationStats, SchedulerStats

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
METRIC_NAME = re.compile(r"\b(?:vllm|pagoda):[A-Za-z0-9_:]+")
INSTALL_HINT = "run scripts/install_prometheus.sh"


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed ({INSTALL_HINT})")
    return path


def run_ok(args: list[str], cwd: Path = DEPLOY) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def populated_registry() -> CollectorRegistry:
    """A registry whose logger has seen one step of every kind of stat."""
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("tiny-model", EngineConfig(), registry=registry)
    aborted = FinishedRequestStats("abort", 12, 3, 16, 1.5, 0.2, 0.3, 1.0, 1.3, 0.5)
    logger.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                       num_blocks_total=128, num_blocks_free=96, num_blocks_cached=8,
                       num_tokens_held=400, num_slots_reserved=512, prefix_cache_queries=64,
                       prefix_cache_hits=16),
        IterationStats(num_prompt_tokens=12, num_generation_tokens=2, num_preemptions=1,
                       step_duration=0.05, time_to_first_tokens=[0.2],
                       inter_token_latencies=[0.04], finished_requests=[aborted],
                       failed_requests={"engine_error": 1}))
    return registry


def exported_names() -> set[str]:
    return {s.name for family in populated_registry().collect() for s in family.samples}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana_dashboard.json").read_text())


def dashboard_panels() -> list[dict]:
    panels = []
    for panel in dashboard()["panels"]:
        panels.extend([panel, *panel.get("panels", [])])
    return [p for p in panels if p.get("type") != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p["targets"]]


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_dashboard_is_grafana_json() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 30
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "model_name", "instance"} <= variables
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]


def test_dashboard_covers_what_operators_watch() -> None:
    exprs = "\n".join(dashboard_exprs())
    for needle in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "rate(vllm:prompt_tokens_total",
                   "rate(vllm:generation_tokens_total", "rate(vllm:num_preemptions_total",
                   "rate(vllm:prefix_cache_hits_total", "pagoda:request_failures_total",
                   "vllm:request_success_total"):
        assert needle in exprs, needle
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(vllm:{histogram}_bucket" in exprs


def test_dashboard_and_alerts_query_only_exported_metrics() -> None:
    exported = exported_names()
    exprs = dashboard_exprs() + [rule["expr"] for rule in alert_rules()]
    queried = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert queried, "no pagoda/vLLM metric found in the queries"
    assert queried - exported == set()


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = require("promtool")
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        for var, sub in (("$__rate_interval", "1m"), ("$model_name", ".*"), ("$instance", ".*")):
            expr = expr.replace(var, sub)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:panel_query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_ok([promtool, "check", "rules", str(path)])


def test_promtool_check_rules() -> None:
    out = run_ok([require("promtool"), "check", "rules", "alerts.yml"])
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_test_rules() -> None:
    run_ok([require("promtool"), "test", "rules", "alerts_test.yml"])


def test_alert_tests_cover_every_alert() -> None:
    tests = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} never expected to fire"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} never expected silent"


def test_promtool_check_config() -> None:
    run_ok([require("promtool"), "check", "config", "prometheus.yml"])
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


# --- a real Prometheus server -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_scraping(target: str, workdir: Path) -> Iterator[str]:
    """Runs Prometheus (1 s scrapes of `target`/metrics, deploy/alerts.yml loaded); yields its URL."""
    binary = require("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "alerts.yml")],
        "scrape_configs": [{"job_name": "pagoda", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target]}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def wait_for(fetch: Callable[[], object | None], what: str, timeout: float, log: Path) -> object:
    """Polls `fetch` until it returns something other than None, for at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = fetch()
        if result is not None:
            return result
        time.sleep(0.25)
    tail = log.read_text()[-3000:] if log.exists() else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail}")


def query_value(base_url: str, promql: str) -> str | None:
    """The single sample value `promql` returns now, or None while there is none."""
    answer = get_json(f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    if not answer or answer["status"] != "success" or len(answer["data"]["result"]) != 1:
        return None
    return answer["data"]["result"][0]["value"][1]


# NOTE: slow (12-14 s on a 2-vCPU Zen 3: a server, then Prometheus scraping it); the metric
# names, the rules and the dashboard's queries are checked against the exporter above in every
# `make test`. Run it with `pytest -m slow`.
@pytest.mark.slow
def test_real_prometheus_scrapes_a_running_pagoda(tiny_llama: Path, tmp_path: Path) -> None:
    require("prometheus")
    server = start_server(tiny_llama, "--dtype", "float32", "--num-kv-blocks", "64",
                          "--served-model-name", "tiny")
    try:
        prompts = [[5, 6, 7], [8, 9, 10, 11]]
        for prompt in prompts:
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        target = server.base_url.removeprefix("http://")
        log = tmp_path / "prometheus.log"
        with prometheus_scraping(target, tmp_path) as prom:
            value = wait_for(lambda: query_value(prom, 'pagoda:kv_blocks{job="pagoda"}'),
                             "pagoda:kv_blocks to be scraped", 20, log)
            assert value == "64"
            success = 'vllm:request_success_total{model_name="tiny", finished_reason="length"}'
            assert query_value(prom, success) == "2"
            assert query_value(prom, 'vllm:request_success_total{finished_reason="abort"}') == "0"
            assert query_value(prom, "vllm:prompt_tokens_total") == str(sum(map(len, prompts)))
            assert query_value(prom, "vllm:generation_tokens_total") == "8"
            assert query_value(prom, "vllm:e2e_request_latency_seconds_count") == "2"
            assert query_value(prom, "pagoda:kv_blocks_free") == "64"
            assert query_value(prom, f'up{{job="pagoda", instance="{target}"}}') == "1"
            rules = get_json(f"{prom}/api/v1/rules")
        assert rules is not None
        loaded = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
        assert loaded == {rule["alert"] for rule in alert_rules()}
    finally:
        server.stop()
