"""How large SmolLM2's top-p sets are on the side-by-side's prompts (the peers' loadgen word
list, 100-150 tokens), offline: 32 prompts, 128 tokens each at temperature 0.8 and top_p 0.9.
Counts the rows whose set ends among the 256 largest logits (`TOP_CANDIDATES`), among 1,024,
and past both (sorted whole), with the sizes of the sets past 256.

    .venv/bin/python docs/benchmarks/sampling/topp_set_sizes.py   (needs ../shared/peers/loadgen.py)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

import pagoda.sampler as sampler_module
from pagoda import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / ".." / "shared" / "peers"))
import loadgen  # noqa: E402

counts = {"within 256": 0, "within 1,024": 0, "sorted whole": 0}
sizes: list[int] = []
widening = sampler_module.widening_candidate_sets


def counting(logits, temps, params):  # type: ignore[no-untyped-def]
    found, rest = widening(logits, temps, params)
    for label, (_, kept, _) in zip(("within 256", "within 1,024"), found, strict=False):
        counts[label] += kept.shape[0]
        if label == "within 1,024":
            sizes.extend((~torch.isinf(kept)).sum(dim=-1).tolist())
    counts["sorted whole"] += len(rest)
    return found, rest


sampler_module.widening_candidate_sets = counting
rng = random.Random(0)
prompts = [loadgen.make_prompt(rng, rng.randint(100, 150), 1.1) for _ in range(32)]
llm = LLM("smollm2", max_model_len=1024)
params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=128, min_tokens=128, ignore_eos=True, seed=0)
llm.generate(prompts, params, use_tqdm=False)
print(counts)
if sizes:
    sizes.sort()
    print(f"sets past 256: {len(sizes)}, sizes min {sizes[0]}, median {sizes[len(sizes) // 2]}, max {sizes[-1]}")
