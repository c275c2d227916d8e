"""`--dtype float16` on a CPU: served as float16 (PAGODA_CPU_FLOAT16=keep, layer by layer in
torch) against what pagoda serves it as where the kernels compute bf16 (bfloat16), SmolLM2,
greedy, 128 tokens: one stream, then 16 prompts at once. Each dtype in its own process.

    .venv/bin/python docs/benchmarks/dtype/float16_cpu.py [ROUNDS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

RUN = """
import time
from pagoda import LLM, SamplingParams
llm = LLM("smollm2", dtype="float16", max_model_len=1024)
p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
t = time.perf_counter(); llm.generate(["Tell me a story."], p, use_tqdm=False); one = 128 / (time.perf_counter() - t)
t = time.perf_counter(); llm.generate([f"Tell me a story {i}." for i in range(16)], p, use_tqdm=False)
many = 16 * 128 / (time.perf_counter() - t)
print(f"float16 served as {next(llm.engine.core.runner.model.parameters()).dtype}: "
      f"one stream {one:.1f} tok/s, 16 prompts {many:.1f} tok/s")
"""


def main(rounds: int) -> None:
    for r in range(rounds):
        for keep in ("keep", ""):
            env = {**os.environ, "PAGODA_CPU_FLOAT16": keep}
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True)
            label = "PAGODA_CPU_FLOAT16=keep" if keep else "default"
            print(f"round {r + 1}, {label:24s} {out.stdout.strip()} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
