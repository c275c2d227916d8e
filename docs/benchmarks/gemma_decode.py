"""Gemma 3 270M Q4_K_M (`--quantization gguf`) offline: 1 and 16 prompts of 120 random tokens,
128 greedy tokens each, output tokens/s. Run from two checkouts, alternating, to compare.
Usage: python docs/benchmarks/gemma_decode.py LABEL
"""
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402

llm = LLM("gemma3-270m", quantization="gguf", enable_prefix_caching=False, max_model_len=2048)
g = torch.Generator().manual_seed(0)
res = []
for c in (1, 16):
    prompts = [torch.randint(100, 40000, (120,), generator=g).tolist() for _ in range(c)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    res.append(f"c={c} {c * 128 / (time.perf_counter() - t):.1f} tok/s")
print(sys.argv[1] if len(sys.argv) > 1 else "", *res)
