"""Prefill time of one prompt on the default model: the best of two runs for prompts of 2,000,
500 and 128 random tokens (prefix caching off, a 512-token budget a step, one token out), bf16
or a scheme of `pagoda bench quality` (int8, int4, gguf, ...); env MODEL names another model
(a GGUF file with the gguf scheme, e.g. a Q4_K_M one).
Run it from two checkouts (e.g. `git worktree add /tmp/base REV`, each with its kernels built)
one after the other, alternating, to compare commits.
Usage: python docs/benchmarks/kernels/prefill_time.py [LABEL [SCHEME]]
"""
import os
import sys
import time

import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.quality import SCHEME_ARGS

scheme = sys.argv[2] if len(sys.argv) > 2 else "bf16"
llm = LLM(os.environ.get("MODEL", "smollm2"), max_num_batched_tokens=512, max_model_len=4096, enable_prefix_caching=False,
          **SCHEME_ARGS[scheme])
prompt = torch.randint(100, 40000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(temperature=0, max_tokens=1)
llm.generate([prompt[:300]], params, use_tqdm=False)  # warm-up
times = []
for n in (2000, 500, 128):
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([prompt[:n]], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    times.append(f"{n} tokens {best:.3f} s")
print(sys.argv[1] if len(sys.argv) > 1 else "", scheme, *times, sep="  ")
