"""A step's feed-forward blocks: top-k of E experts (`FusedMoE`) against the dense MLP of the
same active size (intermediate k * I), random weights (docs/performance.md, "Mixture of experts").

The rest of a decoder layer (attention, norms) is the same in both models, so the blocks alone
show what the experts cost: at one row the two read the same weight bytes (k experts of I
against one MLP of k * I); with more rows the MoE reads more experts for the same FLOPs.

    PYTHONPATH=. python docs/benchmarks/moe_step.py --rows 1 16 128 --dtype bfloat16
"""

from __future__ import annotations

import os

# NOTE: before torch's import, as pagoda's own entry points do: OpenMP threads spinning between
# torch's small operations slow the kernels' own thread pool on shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from pagoda.distributed.group import SINGLE  # noqa: E402
from pagoda.layers import cpu_kernels  # noqa: E402
from pagoda.model_runner import SMALL_STEP_TOKENS, step_threads  # noqa: E402
from pagoda.models.llama import LlamaDims, LlamaFlags, LlamaMLP  # noqa: E402
from pagoda.models.moe import MoeDims, SparseMoeBlock  # noqa: E402
from pagoda.weight_processing import WeightProcessing, process_weights_after_loading  # noqa: E402


def blocks(kind: str, args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.ModuleList:
    """`args.layers` random feed-forward blocks, sparse or dense."""
    torch.manual_seed(0)
    if kind == "moe":
        moe = MoeDims(args.experts, args.top_k, args.intermediate, True, False, 1, frozenset())
        layers = [SparseMoeBlock(args.hidden, moe, SINGLE) for _ in range(args.layers)]
    else:
        d = LlamaDims(args.hidden, args.top_k * args.intermediate, args.layers, 8, 8, args.hidden // 8,
                      1000, 1e-5, False, None)
        layers = [LlamaMLP(d, LlamaFlags(), SINGLE) for _ in range(args.layers)]
    model = torch.nn.ModuleList(layers).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    if args.engine_paths:
        process_weights_after_loading(model, WeightProcessing())
    return model


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=1024, help="each expert's")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-engine-paths", dest="engine_paths", action="store_false",
                    help="leave both on torch/GEMV (no kernel plan for the dense linears, no GEMM panels for the experts)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    models = {kind: blocks(kind, args, dtype) for kind in ("moe", "dense")}
    threads = torch.get_num_threads()
    print(f"{args.layers} layers, hidden {args.hidden}: top-{args.top_k} of {args.experts} experts of "
          f"{args.intermediate} vs dense {args.top_k * args.intermediate}; {args.dtype}, "
          f"{threads} threads (1 under {SMALL_STEP_TOKENS} rows), kernels {'on' if cpu_kernels.available() else 'off'}")
    print("| rows | MoE ms | dense ms | MoE / dense |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            torch.set_num_threads(step_threads(rows, threads))  # NOTE: as the model runner does
            x = torch.randn(rows, args.hidden, dtype=dtype)
            ms = {kind: time_ms(lambda m=m, x=x: [layer(x) for layer in m], args.repeats) for kind, m in models.items()}
            print(f"| {rows} | {ms['moe']:.2f} | {ms['dense']:.2f} | {ms['moe'] / ms['dense']:.2f}x |")


if __name__ == "__main__":
    main()
