"""Whole prefills of one 2,000-token prompt (SmolLM2 bf16, 512-token steps, prefix caching off) in a
loop for SECONDS (default 14) after one warm-up, each one's time printed: a target for
`perf record -D 9000 -g -- python docs/benchmarks/kernels/prefill_loop.py` (the delay skips the
start-up, whose KV pool zeroing and loading would otherwise show).
Usage: python docs/benchmarks/kernels/prefill_loop.py [SECONDS]
"""
import sys
import time

import torch

from pagoda import LLM, SamplingParams

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 14.0
llm = LLM("smollm2", max_num_batched_tokens=512, max_model_len=4096, enable_prefix_caching=False)
prompt = torch.randint(100, 40000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(temperature=0, max_tokens=1)
llm.generate([prompt], params, use_tqdm=False)
begin = time.perf_counter()
while time.perf_counter() - begin < seconds:
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    print(f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
