"""Where a long prompt's prefill goes: the whole prefill of one prompt of N random tokens on
the default model (bf16, prefix caching off, budget B a step) against the time spent inside
the attention layers (the rest is the linears, norms and glue).
Usage: python docs/benchmarks/kernels/prefill_split.py [N=2000] [B=512]
"""
import collections
import sys
import time

import torch

from pagoda import LLM, SamplingParams
from pagoda.layers import attention

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
budget = int(sys.argv[2]) if len(sys.argv) > 2 else 512
llm = LLM("smollm2", max_num_batched_tokens=budget, max_model_len=4096, enable_prefix_caching=False)
spent: collections.Counter = collections.Counter()
forward = attention.PagedAttention.forward


def timed_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    start = time.perf_counter()
    out = forward(*args, **kwargs)
    spent["attention"] += time.perf_counter() - start
    return out


attention.PagedAttention.forward = timed_forward  # type: ignore[method-assign]
prompt = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(temperature=0, max_tokens=1)
llm.generate([prompt[:300]], params, use_tqdm=False)  # warm-up
spent.clear()
start = time.perf_counter()
llm.generate([prompt], params, use_tqdm=False)
total = time.perf_counter() - start
print(f"prompt {n} tokens, budget {budget}: prefill {total:.2f} s, attention {spent['attention']:.2f} s "
      f"({100 * spent['attention'] / total:.0f}%)")
