"""Where a served step's time goes, by phase, at several concurrencies (docs/performance.md).

For each concurrency C it starts `pagoda serve MODEL`, keeps C streaming completions in
flight (prompts of ~120 tokens, 128 output tokens forced), waits for the warm-up, then
samples the server with py-spy for --seconds and counts the engine steps of that window from
/metrics. Each sample is one thread's Python stack; the innermost recognised frame names its
phase (schedule, prepare, linear, attention, ..., HTTP/SSE). The table gives milliseconds of
each phase per engine step and the step's wall time (window / steps).

Usage: .venv/bin/python scripts/profile_served.py [--model smollm2] [--concurrency 1 16 64]
       [--serve-args "--quantization int8"]
Needs py-spy (in the dev extra) and permission to ptrace the server (root, or
kernel.yama.ptrace_scope=0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# (phase, pattern matched against "function (file)" frames, innermost first)
PHASES: list[tuple[str, str]] = [
    ("decoder stack (one native call)", r"NativeDecoder\.__call__"),
    ("attention", r"paged_attention|_decode_native|PagedAttention\._(decode|prefill)|scaled_dot"),
    ("kv write", r"reshape_and_cache|index_copy"),
    ("linear", r"\bgemv\b|Linear\.forward|_linear_pointwise|OpOverloadPacket"),
    ("embedding", r"QuantizedEmbedding|VocabParallelEmbedding|F\.embedding"),
    ("norm", r"rms_norm|RMSNorm"),
    ("rotary", r"rotary"),
    ("activation", r"silu"),
    ("lm head", r"compute_logits"),
    ("sampler", r"Sampler\.|apply_token_constraints|compute_logprobs"),
    ("prepare", r"ModelRunner\._prepare|ModelRunner\._kernel|_block_table"),
    ("model (other)", r"LlamaForCausalLM|LlamaDecoderLayer|LlamaAttention|LlamaMLP|ModelRunner"),
    ("schedule", r"Scheduler\.schedule|BlockManager"),
    ("detokenize", r"IncrementalDetokenizer|DecodeStream"),
    ("outputs", r"make_output|_collect_outputs|SampleState"),
    ("append + stop rules", r"LLMEngine\._append|check_stop|update_from_output"),
    # NOTE: the engine's stats only (`_dequantize_records` is no stats)
    ("stats", r"LLMEngine\._record|stat_logger|StatLogger|\.record \("),
    ("dispatch to HTTP", r"AsyncLLM\._dispatch|_deliver|call_soon_threadsafe"),
]
IDLE = re.compile(r"select \(selectors|Event\.wait|Condition\.wait|_worker \(concurrent|"
                  r"queue\.get|sleep")


def phase_of(thread: str, frames: list[str]) -> str | None:
    """The phase of one sample, or None when the thread was idle."""
    if IDLE.search(frames[-1]):
        return None
    if "pagoda-engine" in thread:
        for frame in reversed(frames):
            for name, pattern in PHASES:
                if re.search(pattern, frame):
                    return name
        return "engine (other)"
    if "MainThread" in thread:
        if any(re.search(r"model_dump_json|sse \(|json|chunks\.py", f) for f in frames[-4:]):
            return "HTTP/SSE: serialize"
        return "HTTP/SSE: server"
    if "asyncio" in thread:
        return "tokenize/template (workers)"
    return "other threads"


def parse(path: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        phase = phase_of(frames[0], frames[1:] or frames)
        if phase is not None:
            counts[phase] += int(n)
    return counts


def num_steps(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(r'^vllm:iteration_tokens_total_count\{[^}]*\} (\S+)', text, re.M)
    return float(match.group(1)) if match else 0.0


async def load(base_url: str, concurrency: int, stop: asyncio.Event) -> None:
    prompt = " ".join(["word"] * 120)
    body = {"prompt": prompt, "max_tokens": 128, "ignore_eos": True, "stream": True,
            "temperature": 0}

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        await stop.wait()
        for task in tasks:
            task.cancel()


def profile(args: argparse.Namespace, concurrency: int) -> dict[str, float]:
    port = 8400 + concurrency
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", args.model,
                               "--port", str(port), "--uvicorn-log-level", "warning",
                               "--disable-log-stats", *args.serve_args.split()], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)

        async def run() -> dict[str, float]:
            stop = asyncio.Event()
            loader = asyncio.create_task(load(base, concurrency, stop))
            await asyncio.sleep(args.warmup)
            out = Path(tempfile.mkdtemp()) / "raw.txt"
            # NOTE: the step time unprofiled first, then the profile (py-spy costs a little).
            before, t0 = num_steps(base), time.monotonic()
            await asyncio.sleep(args.seconds / 2)
            plain_ms = 1e3 * (time.monotonic() - t0) / max(num_steps(base) - before, 1)
            before = num_steps(base)
            spy = await asyncio.create_subprocess_exec(
                args.py_spy, "record", "-p", str(server.pid), "-d", str(args.seconds),
                "-r", str(args.rate), "-f", "raw", "-o", str(out), "--threads", "--nonblocking",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await spy.wait()
            steps = num_steps(base) - before
            stop.set()
            await loader
            counts = parse(out)
            window_ms = 1e3 * args.seconds
            result = {phase: n / args.rate * 1e3 / max(steps, 1) for phase, n in counts.items()}
            result["_step_ms"] = window_ms / max(steps, 1)
            result["_step_ms_unprofiled"] = plain_ms
            result["_steps"] = steps
            return result

        return asyncio.run(run())
    finally:
        server.terminate()
        server.wait(60)


def table(results: dict[int, dict[str, float]]) -> str:
    levels = sorted(results)
    phases = sorted({p for r in results.values() for p in r if not p.startswith("_")},
                    key=lambda p: -max(r.get(p, 0.0) for r in results.values()))
    head = "| phase (ms per step) | " + " | ".join(f"c={c}" for c in levels) + " |"
    rows = [head, "|---|" + "---|" * len(levels)]
    rows += [f"| {p} | " + " | ".join(f"{results[c].get(p, 0.0):.2f}" for c in levels) + " |"
             for p in phases]
    rows.append("| **step wall time (profiled)** | " + " | ".join(
        f"**{results[c]['_step_ms']:.2f}**" for c in levels) + " |")
    rows.append("| step wall time, not profiled | " + " | ".join(
        f"{results[c]['_step_ms_unprofiled']:.2f}" for c in levels) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or
                        str(Path(sys.executable).with_name("py-spy")))
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--serve-args", default="", help="more `pagoda serve` flags, e.g. '--quantization int8'")
    args = parser.parse_args()
    results = {c: profile(args, c) for c in args.concurrency}
    print(table(results))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
