"""Median time of one `Sampler` call on one thread: B greedy rows of SmolLM2's 49,152 bf16
logits with min_tokens pending (EOS masked), as in the side-by-side workload (ignore_eos +
min_tokens). Run it in two checkouts to compare (docs/performance.md, Sampler).
Usage: python docs/benchmarks/kernels/sampler_time.py [B ...]   (default 1 16 64)
"""
import statistics, sys, time
import torch
from pagoda.request import Request
from pagoda.sampler import Sampler
from pagoda.sampling_params import SamplingParams

torch.set_num_threads(1)
for batch in [int(b) for b in sys.argv[1:]] or [1, 16, 64]:
    params = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=0)
    requests = [Request(f"r{i}", [1, 2, 3], params, eos_token_ids={2}) for i in range(batch)]
    logits = torch.randn(batch, 49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sampler = Sampler()
    times = []
    for i in range(60):
        t = time.perf_counter()
        sampler(logits, requests)
        if i >= 10:
            times.append(time.perf_counter() - t)
    print(f"B={batch}: {statistics.median(times) * 1e3:.3f} ms per call")
