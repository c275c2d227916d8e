"""Median LLMEngine.step() time in steady decode for one quantization scheme.

--batch sequences of --prompt random tokens, after the prefill and 5 warm-up steps; the
median of --steps decode steps. --scheme takes the quality bench's names (bf16, int8, int4,
int4-g128, gguf, kv-fp8, ...). Prints one line: scheme, batch, median ms, tok/s.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from pagoda.bench.quality import SCHEME_ARGS  # noqa: E402
from pagoda.engine import LLMEngine  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--scheme", default="bf16", choices=list(SCHEME_ARGS))
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--steps", type=int, default=60)
a = ap.parse_args()
eng = LLMEngine.from_engine_args("smollm2", (), dtype="bfloat16", log_stats=False, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(4096, a.batch * a.prompt), **SCHEME_ARGS[a.scheme])
g = torch.Generator().manual_seed(0)
for _ in range(a.batch):
    ids = torch.randint(100, 40000, (a.prompt,), generator=g).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=a.steps + 20, ignore_eos=True, temperature=0))
eng.step()
for _ in range(5):
    eng.step()
times = []
for _ in range(a.steps):
    t = time.perf_counter()
    eng.step()
    times.append(time.perf_counter() - t)
med = statistics.median(times)
print(f"{a.scheme:10s} batch={a.batch:3d} step median {med * 1e3:7.2f} ms -> {a.batch / med:7.1f} tok/s")
