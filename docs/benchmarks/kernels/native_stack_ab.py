"""The native decoder stack against the layer path in one process: one engine, decode steps
timed in blocks of 10, alternating the runner's `native_decoder` on and off (so that the host's
phases fall on both alike); prints each side's median step over all blocks, and their ratio.
Usage: python docs/benchmarks/kernels/native_stack_ab.py [--model gemma3-270m] [--scheme gguf] [--batch 1] [--blocks 12]
"""
import argparse, os, statistics, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from pagoda.bench.quality import SCHEME_ARGS
from pagoda.engine import LLMEngine
from pagoda.sampling_params import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="gemma3-270m")
ap.add_argument("--scheme", default="gguf", choices=list(SCHEME_ARGS))
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--blocks", type=int, default=12)
a = ap.parse_args()
eng = LLMEngine.from_engine_args(a.model, (), log_stats=False, enable_prefix_caching=False, **SCHEME_ARGS[a.scheme])
runner = eng.runner
native = runner.native_decoder
assert native is not None, "the native stack did not build for this model"
gen = torch.Generator().manual_seed(0)
steps_needed = 20 + 2 * a.blocks * 10
for _ in range(a.batch):
    ids = torch.randint(100, 30000, (32,), generator=gen).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=steps_needed, ignore_eos=True, temperature=0))
for _ in range(10):
    eng.step()
times: dict[bool, list[float]] = {True: [], False: []}
for block in range(2 * a.blocks):
    on = block % 2 == 0
    runner.native_decoder = native if on else None
    for _ in range(10):
        t = time.perf_counter(); eng.step(); times[on].append(time.perf_counter() - t)
runner.native_decoder = native
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(f"{a.model} {a.scheme} batch={a.batch}: native stack {med[True]:.2f} ms, layer path {med[False]:.2f} ms "
      f"a step (median of {len(times[True])}); native / layers {med[True] / med[False]:.3f}")
