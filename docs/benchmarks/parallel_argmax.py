"""Plain greedy steps under TP/PP: the argmax taken on the last stage (token ids come back)
against the logits brought back and sampled in the engine, in one engine, alternating.

    .venv/bin/python docs/benchmarks/parallel_argmax.py [--model smollm2] [-pp 2] [-tp 1]

Prints the bytes a step brings back each way and paired rounds of one greedy generation
(16 streams) with the median time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagoda import LLM, SamplingParams, executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size)
    vocab = llm.engine.processor.vocab_size
    print(f"bytes back a step at {args.streams} rows: logits {args.streams * vocab * 2:,} (bf16), "
          f"argmax {args.streams * 8}")
    prompts = [[1] + list(range(100 + i, 131 + i)) for i in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    argmax = executor.argmax_suffices
    llm.generate(prompts[:2], params, use_tqdm=False)
    ratios = []
    for _ in range(args.rounds):
        times = {}
        for mode in ("argmax", "logits"):
            executor.argmax_suffices = argmax if mode == "argmax" else (lambda requests: False)  # type: ignore[assignment]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[mode] = time.perf_counter() - start
        ratios.append(times["argmax"] / times["logits"])
        print(f"  argmax {times['argmax']:.2f} s, logits {times['logits']:.2f} s")
    executor.argmax_suffices = argmax
    print(f"argmax / logits time, median of {args.rounds}: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
