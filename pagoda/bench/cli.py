"""The `pagoda bench` command: serve, sweep, throughput, latency, memory, prefix-caching, soak,
structured, spec-decode, quality, random-model, fairness.

`add_bench_parser(subparsers)` hangs it under the main `pagoda` parser; each subcommand sets
`args.func`, which returns the exit status (the results are the module `main`s' return
values). `python -m pagoda.bench.cli ...` runs it standalone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

# NOTE: OpenMP spin-waiting on shared cores slows torch 5-10x; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# subcommand -> the module whose main(args) runs it
MODULES = {"serve": "serve_command", "sweep": "sweep", "throughput": "throughput",
           "latency": "latency", "memory": "memory", "prefix-caching": "prefix_caching",
           "soak": "soak", "structured": "structured", "spec-decode": "spec_decode",
           "quality": "quality", "random-model": "random_model", "fairness": "fairness"}


def run_command(args: argparse.Namespace) -> Any:
    """Runs the parsed `bench` subcommand and returns its results (for tests and scripts)."""
    module = importlib.import_module(f"pagoda.bench.{MODULES[args.bench_command]}")
    return module.main(args)


def _handle(args: argparse.Namespace) -> int:
    run_command(args)
    return 0


def _add(sub: Any, name: str, help_text: str,
         add_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    add_args(parser)
    parser.set_defaults(func=_handle)
    return parser


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` and its subcommands to the `pagoda` command's subparsers."""
    from pagoda.bench.fairness import add_fairness_args
    from pagoda.bench.latency import add_latency_args
    from pagoda.bench.memory import add_memory_args
    from pagoda.bench.prefix_caching import add_prefix_caching_args
    from pagoda.bench.quality import add_quality_args
    from pagoda.bench.random_model import add_random_model_args
    from pagoda.bench.serve_command import add_serve_args
    from pagoda.bench.soak import add_soak_args
    from pagoda.bench.spec_decode import add_spec_decode_args
    from pagoda.bench.structured import add_structured_args
    from pagoda.bench.sweep import add_sweep_args
    from pagoda.bench.throughput import add_throughput_args

    def sweep_args(parser: argparse.ArgumentParser) -> None:
        add_serve_args(parser)
        add_sweep_args(parser)

    bench = subparsers.add_parser("bench", help="Benchmark pagoda (or any OpenAI server).",
                                  description="Benchmarks: serve, sweep, throughput, latency, memory.")
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,sweep,throughput,latency,memory,prefix-caching,soak,structured,"
                                "spec-decode,quality,random-model,fairness}")
    sub.required = True
    _add(sub, "serve", "Load-test an OpenAI-compatible server (vllm bench serve's flags).",
         add_serve_args)
    _add(sub, "sweep", "Run bench serve over concurrencies or rates; plot and pick the sweet spot.",
         sweep_args)
    _add(sub, "throughput", "Offline tokens/s of pagoda and/or plain transformers.",
         add_throughput_args)
    _add(sub, "latency", "Offline batch latency and single-stream decode speed.",
         add_latency_args)
    _add(sub, "memory", "Replay a workload through paged vs contiguous KV allocation.",
         add_memory_args)
    _add(sub, "prefix-caching", "TTFT of requests sharing a ~1,000-token system prompt, cold vs warm.",
         add_prefix_caching_args)
    _add(sub, "soak", "Hours of mixed, aborted and malformed traffic against a pagoda server it "
         "starts; fails on any failed request, KV leak or rising RSS.", add_soak_args)
    _add(sub, "spec-decode", "Speculative decoding's speed-up on answers that copy their "
         "input (single stream), and its cost on random prompts (batched).", add_spec_decode_args)
    _add(sub, "structured", "Output tok/s with every request JSON-constrained vs free, and "
         "grammar compile latency.", add_structured_args)
    _add(sub, "quality", "Perplexity on Python's own docs and greedy agreement with the "
         "unquantized model, per quantization scheme and KV cache dtype.", add_quality_args)
    _add(sub, "random-model", "Write a random-weight Llama of a named shape (1B, 8B) with SmolLM2's "
         "tokenizer, for speed figures on weights larger than any cache.", add_random_model_args)
    _add(sub, "fairness", "A probe's time to first token behind one request of 1,000 prompts, "
         "against idle and against plain first come, first served.", add_fairness_args)
    return bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
