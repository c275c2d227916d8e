"""`pagoda bench throughput`: offline tokens/s of pagoda, and of plain transformers.

The default workload is realistic rather than flattering: 64 requests, prompts of 32-256
random tokens and outputs of 16-256 tokens (uniform, seed 0), each output forced to its own
length. `--backend both` runs pagoda and the transformers baseline on the same prompts, in
the same dtype, in one run, and prints them side by side with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.backends import Backend, make_backend, timed
from pagoda.bench.datasets import SampleRequest, length_range, load_tokenizer, random_requests
from pagoda.config import INT4_GROUP_SIZES, KV_CACHE_DTYPES, QUANTIZATIONS


@dataclass
class OfflineResult:
    """One backend's run over the whole workload."""

    backend: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "requests_per_second": self.requests_per_s,
                "tokens_per_second": self.total_tokens_per_s,
                "output_tokens_per_second": self.output_tokens_per_s}


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    """Model, dtype, seed, backend and engine flags shared by throughput and latency."""
    add = parser.add_argument
    add("--backend", default="pagoda", choices=["pagoda", "hf", "both"],
        help="hf: plain transformers generate; both: side by side with the ratio.")
    add("--model", default="smollm2")
    add("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add("--seed", type=int, default=0)
    add("--output-json", default=None, help="Write the results here as JSON.")
    engine = parser.add_argument_group("pagoda engine")
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None)
    engine.add_argument("-tp", "--tensor-parallel-size", type=int, default=None)
    engine.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None)
    engine.add_argument("-q", "--quantization", choices=QUANTIZATIONS, default=None)
    engine.add_argument("--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=None)
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)
    engine.add_argument("--core-process", action="store_true", default=None,
                        help="the engine core in a process of its own (what it costs)")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_offline_args(parser)
    add = parser.add_argument
    add("--num-prompts", type=int, default=64)
    add("--input-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    add("--output-len-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    add("--input-len", type=int, default=None, help="vLLM style: overrides --input-len-range.")
    add("--output-len", type=int, default=None, help="vLLM style: overrides --output-len-range.")
    add("--random-range-ratio", type=float, default=0.0)
    add("--hf-max-batch-size", "--hf-batch-size", dest="hf_batch_size", type=int, default=32)
    add("--num-warmups", type=int, default=1, help="Short warm-up requests per backend.")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as LLM(...) keyword arguments."""
    names = ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
             "kv_cache_memory", "enable_prefix_caching", "tensor_parallel_size",
             "pipeline_parallel_size", "quantization", "quantization_group_size", "kv_cache_dtype",
             "core_process"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_workload(args: argparse.Namespace) -> list[SampleRequest]:
    """The seeded random token-id workload the flags describe."""
    ratio = args.random_range_ratio
    low, high = args.input_len_range
    in_range = length_range(args.input_len, ratio) if args.input_len else (low, high)
    low, high = args.output_len_range
    out_range = length_range(args.output_len, ratio) if args.output_len else (low, high)
    return random_requests(load_tokenizer(args.model), args.num_prompts, in_range, out_range,
                           seed=args.seed, as_text=False)


def run_backend(backend: Backend, requests: list[SampleRequest], num_warmups: int) -> OfflineResult:
    """Warms up on short requests, then times the whole workload in one call."""
    prompts = token_prompts(requests)
    lens = [r.expected_output_len for r in requests]
    if num_warmups > 0:
        warm = [p[:16] for p in prompts[:num_warmups]]
        backend.generate(warm, [4] * len(warm))
    elapsed, useful = timed(backend, prompts, lens, use_tqdm=True)
    return OfflineResult(backend.name, len(requests), sum(r.prompt_len for r in requests),
                         useful, elapsed)


def token_prompts(requests: list[SampleRequest]) -> list[list[int]]:
    prompts = []
    for r in requests:
        if isinstance(r.prompt, str):
            raise TypeError("offline benchmarks take token-id prompts.")
        prompts.append(list(r.prompt))
    return prompts


def format_result(result: OfflineResult) -> str:
    """vLLM's lines for one backend."""
    return (f"[{result.backend}] Throughput: {result.requests_per_s:.2f} requests/s, "
            f"{result.total_tokens_per_s:.2f} total tokens/s, "
            f"{result.output_tokens_per_s:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {result.num_prompt_tokens}\n"
            f"Total num output tokens:  {result.num_output_tokens}")


def format_comparison(results: list[OfflineResult]) -> str:
    """The side-by-side table, with pagoda/hf ratios when both ran."""
    head = f"{'backend':<8}{'elapsed s':>11}{'requests/s':>12}{'total tok/s':>13}{'output tok/s':>14}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.backend:<8}{r.elapsed_s:>11.2f}{r.requests_per_s:>12.3f}"
                     f"{r.total_tokens_per_s:>13.1f}{r.output_tokens_per_s:>14.1f}")
    by_name = {r.backend: r for r in results}
    if "pagoda" in by_name and "hf" in by_name:
        ratio = by_name["pagoda"].output_tokens_per_s / by_name["hf"].output_tokens_per_s
        lines.append(f"pagoda / hf output tokens/s: {ratio:.2f}x")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """What the figures depend on besides the code."""
    return {"date": datetime.now().isoformat(timespec="seconds"),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "torch_num_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor(), **cpu_environment()}


def cpu_environment() -> dict[str, Any]:
    """The CPU model, the flags that pick kernels and matrix units, and the kernel build."""
    from pagoda.layers import cpu_kernels
    from pagoda.layers.cpu_kernels import loader

    flags = loader.cpu_flags()
    lib = cpu_kernels.library()
    return {"cpu_model": loader.cpu_model(), "cpu_flags": [f for f in loader.MATRIX_FLAGS if f in flags],
            "kernel_variant": lib.variant if lib is not None else "none"}


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    print(f"Saved results to {path}")


def main(args: argparse.Namespace) -> list[OfflineResult]:
    """The `bench throughput` handler."""
    requests = build_workload(args)
    names = ["pagoda", "hf"] if args.backend == "both" else [args.backend]
    results = []
    for name in names:
        print(f"Loading {name} ({args.model}, {args.dtype})...")
        backend = make_backend(name, args.model, args.dtype, engine_kwargs(args),
                               args.hf_batch_size)
        results.append(run_backend(backend, requests, args.num_warmups))
        print(format_result(results[-1]))
        del backend
    print(format_comparison(results))
    if args.output_json:
        write_json(args.output_json, {
            "workload": {"num_prompts": len(requests), "seed": args.seed,
                         "input_lens": [r.prompt_len for r in requests],
                         "output_lens": [r.expected_output_len for r in requests],
                         "dtype": args.dtype, "model": args.model,
                         "hf_batch_size": args.hf_batch_size, "engine": engine_kwargs(args)},
            "environment": environment(), "results": [r.to_dict() for r in results]})
    return results
