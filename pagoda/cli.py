"""The `pagoda` command: serve | generate | tune | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pagoda.config import QUANTIZATIONS

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate once from the shell")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("-q", "--quantization", choices=QUANTIZATIONS, default=None,
                   help="gguf: a quantized GGUF's blocks kept packed (the start-up log says how many linears)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, quantization=args.quantization)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.time()
    if args.no_chat or not getattr(llm.tokenizer, "chat_template", None):
        outs = llm.generate(args.prompt, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    elapsed = time.time() - start
    for out in outs:
        o = out.outputs[0]
        print(o.text)
        print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]", file=sys.stderr)
    print(f"[{elapsed:.2f} s]", file=sys.stderr)
    return 0


def _add_tune_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune", help="measure which CPU kernel each linear takes, by row count, and cache the plan",
        description="Times every linear path this CPU has (own GEMV/GEMM, oneDNN, torch) on the model's "
                    "bf16 weight shapes at each row bucket, prints the timings and the plan, and replaces "
                    "the cached plan that `pagoda serve` reads at start. PAGODA_LINEAR_COPIES=2 allows a "
                    "second copy of a weight where it is faster; PAGODA_LINEAR_PLAN forces a plan. On the "
                    "avx512bf16 build it first times the GEMM's two tile kinds again (PAGODA_GEMM_TILE "
                    "forces them).")
    p.add_argument("model", nargs="?", default="smollm2")
    p.set_defaults(func=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    import torch

    from pagoda.layers import cpu_kernels
    from pagoda.models.loader import load_hf_config, load_model, resolve_model_path
    from pagoda.weight_processing import plan_linears

    path = resolve_model_path(args.model)
    hf_config = load_hf_config(path)
    model = load_model(path, hf_config, torch.bfloat16, torch.device("cpu"), 16)
    lib = cpu_kernels.library()
    if lib is not None and lib.variant in cpu_kernels.gemm_tiles.BUILDS:
        cpu_kernels.choose_gemm_tiles(lib, retune=True)
        ops = cpu_kernels.ops
        choice = cpu_kernels.gemm_tiles.TileChoice(ops.GEMM_FMA_ROWS, ops.GEMM_AMX_ROWS, ops.GEMM_AMX_INTEGER_ROWS[8],
                                                   ops.GEMM_AMX_INTEGER_ROWS[4], ops.GEMM_PREFETCH_ROWS)
        print(f"GEMM tiles: {cpu_kernels.gemm_tiles.describe(choice, lib.variant)}")
    plan = plan_linears(model, retune=True)
    if plan is None:
        print("no bf16 linear to plan (PAGODA_DISABLE_CPU_KERNELS set, or no such layer)", file=sys.stderr)
        return 1
    print(plan.describe())
    print("milliseconds per weight:" if plan.timings else "(forced: nothing measured)")
    for line in plan.timing_table():
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Fast LLM serving on the hardware you own.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    from pagoda.server.serve import add_serve_parser

    add_serve_parser(subparsers)
    _add_generate_parser(subparsers)
    _add_tune_parser(subparsers)
    from pagoda.bench.cli import add_bench_parser

    add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from pagoda.server.config_file import expand_config_file
    from pagoda.server.serve import vllm_spelling

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = expand_config_file(argv, negatable_flags(parser, "serve"))
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(vllm_spelling(argv))
    return int(args.func(args) or 0)


def negatable_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The `--no-...` spellings of `command`'s flags (for a config file's false values)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return {o for o in action.choices[command]._option_string_actions if o.startswith("--no-")}
    return set()


if __name__ == "__main__":
    sys.exit(main())
