"""What `--stream-interval` buys a served SmolLM2 at 64 streams: output tok/s and the
server's chunks, interval 1 (every step's token) against larger ones, alternating.

    .venv/bin/python docs/benchmarks/stream_interval.py [--intervals 1 8] [--rounds 2]

Each round starts `pagoda serve smollm2 --stream-interval K`, runs `pagoda bench serve` (random
prompts of 128 tokens, 128 out with ignore_eos, 192 prompts at concurrency 64), stops the server,
then the next interval. Prints one line per run and the mean per interval.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PORT = 8391


def serve(interval: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", "smollm2", "--port", str(PORT),
                             "--stream-interval", str(interval), "--disable-log-stats",
                             "--uvicorn-log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def bench(out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
                    "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
                    "--num-prompts", "192", "--max-concurrency", "64", "--ignore-eos", "--num-warmups", "8",
                    "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[int, list[float]] = {k: [] for k in args.intervals}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in args.intervals:
                proc = serve(k)
                try:
                    res = bench(Path(tmp) / f"k{k}_r{r}.json")
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                results[k].append(res["output_throughput"])
                print(f"round {r} interval {k}: {res['output_throughput']:.1f} out tok/s, "
                      f"TTFT p50 {res['median_ttft_ms']:.0f} ms", flush=True)
    for k, values in results.items():
        print(f"interval {k}: mean {sum(values) / len(values):.1f} out tok/s over {len(values)} runs")


if __name__ == "__main__":
    main()
