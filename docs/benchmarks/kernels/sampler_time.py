"""Median time of one `Sampler` call on one thread, B rows of SmolLM2's 49,152 bf16 logits:
- greedy rows with min_tokens pending (EOS masked), as in the side-by-side workload
  (ignore_eos + min_tokens);
- seeded rows at temperature 1 alone (OpenAI's defaults), over N(0, 1) logits;
- seeded rows with min_p 0.05 alone over the N(0, 4^2) logits;
- seeded rows at temperature 1 with repetition (1.1), presence (0.5) and frequency (0.3) penalties over 1,000-token
  prompts and 500-token answers;
- seeded rows with temperature 0.8 and top_p 0.9 over peaked logits (N(0, 4^2): a few hundred
  tokens hold the top-p mass), with a row's top-p set looked for among its largest logits
  (`TOP_CANDIDATES`) and with a whole sort (`--whole-sort`), alternating.
Run it in two checkouts to compare (docs/performance.md, Sampler).
Usage: python docs/benchmarks/kernels/sampler_time.py [B ...]   (default 1 16 64)
"""
import statistics
import sys
import time

import torch

from pagoda import sampler as sampler_module
from pagoda.request import Request
from pagoda.sampler import Sampler
from pagoda.sampling_params import SamplingParams

torch.set_num_threads(1)
CASES = {"greedy": SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=0),
         "seeded temperature 1": SamplingParams(max_tokens=128, temperature=1.0, seed=1),
         "seeded top-p": SamplingParams(max_tokens=128, temperature=0.8, top_p=0.9, seed=1),
         "seeded min-p": SamplingParams(max_tokens=128, temperature=1.0, min_p=0.05, seed=1),
         "penalties": SamplingParams(max_tokens=600, temperature=1.0, seed=1, repetition_penalty=1.1,
                                     presence_penalty=0.5, frequency_penalty=0.3)}


def median_ms(requests: list[Request], logits: torch.Tensor, calls: int = 30) -> float:
    sampler, times = Sampler(), []
    for i in range(calls + 5):
        t = time.perf_counter()
        sampler(logits, requests)
        if i >= 5:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


candidates = getattr(sampler_module, "TOP_CANDIDATES", None)
for batch in [int(b) for b in sys.argv[1:]] or [1, 16, 64]:
    g = torch.Generator().manual_seed(0)
    for name, params in CASES.items():
        requests = [Request(f"r{i}", [1, 2, 3], params, eos_token_ids={2}) for i in range(batch)]
        if params.repetition_penalty != 1:  # NOTE: 1,000-token prompts, 500 tokens answered
            requests = [Request(f"r{i}", torch.randint(3, 49152, (1000,), generator=g).tolist(), params)
                        for i in range(batch)]
            for r in requests:
                for t in torch.randint(3, 49152, (500,), generator=g).tolist():
                    r.append_token(t)
        logits = (torch.randn(batch, 49152, generator=g) * (4 if params.top_p < 1 or params.min_p else 1)).to(torch.bfloat16)
        if params.top_p == 1 or candidates is None:
            print(f"B={batch} {name}: {median_ms(requests, logits):.3f} ms per call")
            continue
        for whole in (False, True, False, True):
            sampler_module.TOP_CANDIDATES = 49152 if whole else candidates
            print(f"B={batch} {name}{' (whole sort)' if whole else ''}: "
                  f"{median_ms(requests, logits, 10):.3f} ms per call")
        sampler_module.TOP_CANDIDATES = candidates
