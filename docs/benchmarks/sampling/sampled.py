"""Sampling's cost in a batch: SmolLM2, 16 chat prompts to 128 tokens each, greedy, sampled at
temperature 1, sampled with top-p (temperature 0.8, top_p 0.9, as chat clients send), and
sampled at temperature 1 with `--watermark-config`, alternating (output tok/s each round).

    .venv/bin/python docs/benchmarks/sampling/sampled.py [ROUNDS]
"""

from __future__ import annotations

import sys
import time

from pagoda import LLM, SamplingParams

TOPICS = ["a lighthouse", "rainbows", "a weekend trip", "a favourite meal", "the moon", "bees",
          "a train journey", "chess", "the sea", "bread", "a library", "winter", "rivers",
          "a garden", "clocks", "mountains"]


def main(rounds: int) -> None:
    chats = [[{"role": "user", "content": f"Write a paragraph about {t}."}] for t in TOPICS]
    sampled = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=1)
    plain = LLM("smollm2", max_model_len=1024)
    runs = {"greedy": (plain, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)),
            "sampled": (plain, sampled),
            "top-p": (plain, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=128, ignore_eos=True, seed=1)),
            "watermarked": (LLM("smollm2", max_model_len=1024, watermark_config={"key": 42}), sampled)}
    for llm, _ in runs.values():
        llm.chat(chats[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # NOTE: warm-up
    for r in range(rounds):
        for name, (llm, params) in runs.items():
            start = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            took = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"round {r + 1} {name:12s} {tokens} tokens in {took:.2f} s: {tokens / took:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
