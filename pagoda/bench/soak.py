"""`pagoda bench soak`: hours of mixed, aborted and malformed traffic; it must stay healthy.

It starts `pagoda serve MODEL` itself (so it can read the server's RSS), then keeps
--concurrency clients busy with a random mix:
- valid: completions and chats, streamed or not, greedy or seeded, n > 1, stop strings,
  logprobs; every one must succeed with exactly the tokens it asked for (ignore_eos);
- aborted: a streamed request whose client disconnects after a few chunks;
- malformed: bad JSON, out-of-range values, a lone surrogate, a huge n, an oversized body;
  every one must get a 4xx, never a 5xx or a 200;
- hostile (--hostile-ratio): valid but heavy requests: a nested JSON schema or a regex to
  compile and follow, a choice among hundreds of options, dozens of prompts in one request,
  128 bad words, the widest repetition detection; each must succeed or be refused with a 4xx (a limit), never a 5xx or a dropped connection.
Every --interval a probe (one short streamed completion) measures the time to its first
token under the load; then the load pauses until the server is idle, and the report line
gives the throughput, the probe's latency, the server's RSS and the KV pool's idle state. The run fails (exit 1) on any
failed valid request, any malformed request not refused with a 4xx, a KV block still held
when idle, or an RSS that rose by more than --max-rss-growth over the run beyond the pages
of KV blocks used for the first time (the pool's pages are resident once written; that is
its configured size, not a leak).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = ["Tell me about the sea.", "Write a haiku about autumn.", "What is 12 times 7?",
           "List three colours.", "Explain paging in operating systems.", "Once upon a time"]
MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
    ("/v1/completions", b'{"prompt": "hi", "n": 9223372036854775808, "temperature": 1}'),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [999999999], "min_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "hi\\ud800"}'),
    ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}'),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 1e30}'),
    ("/v1/completions", b'{"prompt": [999999999]}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/tokenize", b'{"prompt": "' + b"x" * 300_000 + b'"}'),
    ("/v1/messages", b'{"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}'),
    ("/inference/v1/generate", b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": "x", "logprobs": true}}'),
]
NESTED_SCHEMA = {"type": "object", "required": ["name", "items"], "properties": {
    "name": {"type": "string", "maxLength": 12},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "required": ["id", "tags"], "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}}}


CHOICE_LISTS = 64


WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "required": ["city"],
                                                 "properties": {"city": {"type": "string"}}}}


def hostile_bodies(rng: random.Random, model: str = "smollm2") -> list[tuple[str, dict[str, Any]]]:
    """Valid, heavy requests: (path, body); `model`: the served name (Anthropic's API needs it)."""
    which = rng.randrange(CHOICE_LISTS)
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A JSON record, please."}],
                                  "max_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "record", "schema": NESTED_SCHEMA}}}),
        ("/v1/completions", {"prompt": "Pick one:", "max_tokens": 8,
                             "structured_outputs": {"regex": r"(yes|no|maybe)( [0-9]{1,3}){0,4}"}}),
        # NOTE: one of CHOICE_LISTS distinct lists: each is compiled once in the grammar sandbox,
        # then the engine's grammar cache (an LRU of 256) holds them all, so a leak shows as RSS
        # that keeps rising, not as the bounded cache filling (with a new list every time the
        # cache filled for 40 minutes: +103 MB in a 30-minute run, docs/benchmarks.md)
        ("/v1/completions", {"prompt": "Pick one:", "max_tokens": 8,
                             "structured_outputs": {"choice": [f"option {i} of list {which}" for i in range(300)]}}),
        ("/v1/completions", {"prompt": [rng.choice(PROMPTS) for _ in range(24)], "max_tokens": 4}),
        # NOTE: vLLM's bad_words at the limit (each word tokenized twice, masks every step) and
        # repetition_detection at its widest pattern (every size tried after every token)
        ("/v1/completions", {"prompt": rng.choice(PROMPTS), "max_tokens": 16,
                             "bad_words": [f"{rng.choice(PROMPTS).split()[0]}{i}" for i in range(128)]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                                  "max_tokens": 48, "repetition_detection": {"max_pattern_size": 256,
                                                                             "min_count": 2}}),
        # NOTE: Anthropic's Messages API streaming a forced tool call after a tool round trip, and
        # vLLM's token-in, token-out generate streaming n samples with logprobs in chunks
        ("/v1/messages", {"model": model, "max_tokens": 32, "stream": True, "tools": [WEATHER],
                          "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [
                              {"role": "user", "content": rng.choice(PROMPTS)},
                              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                                 "name": "get_weather", "input": {"city": "Oslo"}}]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                            "content": "Rain"}]}]}),
        ("/inference/v1/generate", {"token_ids": [rng.randrange(1, 1000) for _ in range(64)], "stream": True,
                                    "sampling_params": {"n": 4, "temperature": 1.0, "max_tokens": 24, "logprobs": 5,
                                                        "stream_interval": 3}}),
    ]


@dataclass
class Tally:
    """Counts for one interval (and the run)."""

    ok: int = 0
    aborted: int = 0
    refused: int = 0
    hostile: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.ok += other.ok
        self.aborted += other.aborted
        self.refused += other.refused
        self.hostile += other.hostile
        self.tokens += other.tokens
        self.failures += other.failures


def parse_duration(text: str) -> float:
    """'90', '90s', '10m' or '2h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 10m or 2h, got {text!r}") from None


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2", help="model to serve (default smollm2)")
    add("--duration", type=parse_duration, default=600.0, help="e.g. 10m, 2h (default 10m)")
    add("--interval", type=parse_duration, default=60.0, help="report period (default 60s)")
    add("--concurrency", type=int, default=8)
    add("--max-tokens", type=int, default=32, help="tokens per valid request")
    add("--abort-ratio", type=float, default=0.15)
    add("--malformed-ratio", type=float, default=0.15)
    add("--hostile-ratio", type=float, default=0.1,
        help="share of valid but heavy requests: grammars, big choices, many prompts (default 0.1)")
    add("--max-rss-growth", type=float, default=0.10,
        help="allowed RSS rise from the first to the last report, as a fraction (default 0.10)")
    add("--port", type=int, default=8011)
    add("--seed", type=int, default=0)
    add("--output-json", default=None, help="write the per-interval reports here")
    add("--server-arg", action="append", default=[], metavar="ARG",
        help="extra `pagoda serve` argument (repeatable), e.g. --server-arg=--dtype=float32")


class Soak:
    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient, pid: int) -> None:
        self.args = args
        self.client = client
        self.pid = pid
        self.rng = random.Random(args.seed)
        self.paused = asyncio.Event()
        self.tally = Tally()

    # ---- one request of each kind --------------------------------------------------------
    async def valid(self) -> None:
        chat = self.rng.random() < 0.5
        n = 2 if self.rng.random() < 0.15 else 1
        body: dict[str, Any] = {"max_tokens": self.args.max_tokens, "ignore_eos": True,
                                "temperature": 0 if n == 1 and self.rng.random() < 0.5 else 0.8,
                                "seed": self.rng.randrange(2**31), "n": n,
                                "stream": self.rng.random() < 0.5}
        if self.rng.random() < 0.2:
            body["logprobs"] = 2 if not chat else True
        prompt = self.rng.choice(PROMPTS)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
            usage = await self._stream(path, body)
        else:
            r = await self.client.post(path, json=body)
            usage = r.json().get("usage") if r.status_code == 200 else None
            if r.status_code != 200:
                self.tally.failures.append(f"{path} -> {r.status_code}: {r.text[:200]}")
                return
        expected = self.args.max_tokens * n
        if usage is None or usage["completion_tokens"] != expected:
            self.tally.failures.append(f"{path} usage {usage} != {expected} tokens")
            return
        self.tally.ok += 1
        self.tally.tokens += expected

    async def _stream(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        usage = None
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.tally.failures.append(f"{path} stream -> {r.status_code}")
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.failures.append(f"{path} stream error {chunk['error']}")
                    return None
                usage = chunk.get("usage") or usage
        return usage

    async def abort(self) -> None:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        keep = self.rng.randrange(1, 6)
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            async for i, _ in _aenumerate(r.aiter_lines()):
                if i >= keep:
                    break
        self.tally.aborted += 1

    async def malformed(self) -> None:
        path, body = self.rng.choice(MALFORMED)
        r = await self.client.post(path, content=body, headers={"Content-Type": "application/json"})
        if 400 <= r.status_code < 500:
            self.tally.refused += 1
        else:
            self.tally.failures.append(f"malformed {body[:60]!r} -> {r.status_code}")

    async def hostile(self) -> None:
        path, body = self.rng.choice(hostile_bodies(self.rng, self.args.model))
        r = await self.client.post(path, json=body)
        if r.status_code == 200 or 400 <= r.status_code < 500:
            self.tally.hostile += 1
        else:
            self.tally.failures.append(f"hostile {path} {str(body)[:60]} -> {r.status_code}: {r.text[:200]}")

    async def probe(self) -> float | None:
        """Seconds to the first token of one short streamed completion (None if it failed)."""
        start = time.monotonic()
        body = {"prompt": "Hello", "max_tokens": 2, "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return round(time.monotonic() - start, 3)
        self.tally.failures.append(f"probe -> {r.status_code}")
        return None

    # ---- the run -------------------------------------------------------------------------
    async def worker(self, stop_at: float) -> None:
        a = self.args
        while time.monotonic() < stop_at:
            await self.paused.wait()
            roll = self.rng.random()
            try:
                if roll < a.malformed_ratio:
                    await self.malformed()
                elif roll < a.malformed_ratio + a.abort_ratio:
                    await self.abort()
                elif roll < a.malformed_ratio + a.abort_ratio + a.hostile_ratio:
                    await self.hostile()
                else:
                    await self.valid()
            except httpx.HTTPError as e:
                self.tally.failures.append(f"transport {type(e).__name__}: {e}")

    async def report(self, index: int, started: float, interval: float) -> dict[str, Any]:
        """Probes the latency under load, pauses the load, waits for the server to idle, and
        reads RSS and the KV pool."""
        probe = await self.probe()
        self.paused.clear()
        kv = await self._idle_kv()
        tally, self.tally = self.tally, Tally()
        line = {"t_min": round((time.monotonic() - started) / 60, 2), "ok": tally.ok,
                "aborted": tally.aborted, "refused": tally.refused, "hostile": tally.hostile,
                "probe_ttft_s": probe,
                "output_tok_s": round(tally.tokens / interval, 1), "rss_mb": rss_mb(self.pid),
                "kv_blocks_held_idle": kv["num_blocks"] - kv["num_blocks_free"],
                "kv_touched_mb": round(kv["pool_bytes_touched"] / 2**20, 1),
                "failures": tally.failures[:5], "num_failures": len(tally.failures)}
        print(json.dumps(line), flush=True)
        self.paused.set()
        return line

    async def _idle_kv(self) -> dict[str, Any]:
        deadline = time.monotonic() + 120
        while True:
            kv = (await self.client.get("/kv_cache")).json()
            if kv["num_running_requests"] == 0 or time.monotonic() > deadline:
                return kv
            await asyncio.sleep(0.2)


async def _aenumerate(lines: Any) -> Any:
    i = 0
    async for line in lines:
        yield i, line
        i += 1


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def verdict(lines: list[dict[str, Any]], max_growth: float) -> list[str]:
    """What makes the run fail: failures, KV held while idle, RSS growth."""
    problems = [f"interval {i}: {line['num_failures']} failed requests, e.g. {line['failures']}"
                for i, line in enumerate(lines) if line["num_failures"]]
    problems += [f"interval {i}: {line['kv_blocks_held_idle']} KV blocks held while idle"
                 for i, line in enumerate(lines) if line["kv_blocks_held_idle"]]
    if len(lines) >= 2:
        # NOTE: the KV pool's pages become resident as its blocks are first used; that growth
        # (bounded by --kv-cache-memory) is not a leak, so it is taken out.
        first, last = lines[0], lines[-1]
        kv_growth = last.get("kv_touched_mb", 0.0) - first.get("kv_touched_mb", 0.0)
        growth = last["rss_mb"] - first["rss_mb"] - kv_growth
        if growth > first["rss_mb"] * max_growth:
            problems.append(f"RSS rose from {first['rss_mb']} MB to {last['rss_mb']} MB, "
                            f"{growth:.0f} MB beyond the KV pool's newly used pages "
                            f"(> {max_growth:.0%})")
    return problems


async def run_soak(args: argparse.Namespace, base_url: str, pid: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        soak = Soak(args, client, pid)
        soak.paused.set()
        started = time.monotonic()
        stop_at = started + args.duration
        workers = [asyncio.create_task(soak.worker(stop_at)) for _ in range(args.concurrency)]
        lines: list[dict[str, Any]] = []
        next_report = started + args.interval
        while time.monotonic() < stop_at:
            await asyncio.sleep(max(0.0, min(next_report, stop_at) - time.monotonic()))
            if time.monotonic() >= next_report or time.monotonic() >= stop_at:
                lines.append(await soak.report(len(lines), started, args.interval))
                next_report += args.interval
        await asyncio.gather(*workers)
        return lines


def start_server(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", args.model, "--port", str(args.port),
           "--uvicorn-log-level", "warning", "--disable-log-stats", "--enable-scale-out", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: "
                               f"{proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


def main(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one line per request otherwise
    proc = start_server(args)
    try:
        lines = asyncio.run(run_soak(args, f"http://127.0.0.1:{args.port}", proc.pid))
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(60)
    problems = verdict(lines, args.max_rss_growth) + ([] if alive else ["the server died"])
    result = {"intervals": lines, "problems": problems, "passed": not problems}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    print("soak " + ("PASSED" if not problems else "FAILED: " + "; ".join(problems)), flush=True)
    if problems:
        raise SystemExit(1)
    return result
