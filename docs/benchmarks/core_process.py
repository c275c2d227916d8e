"""What the engine core in a process of its own costs (`--core-process`, pagoda/core_client.py).

One engine of each kind, side by side in this process: the core in process, and the core in
its own process behind `CoreProcessClient`. Prints the round trip of an empty call, the
pickled size of one step's outputs at 16 sequences, and paired rounds of the same greedy
generation (1 and 16 streams) on each, alternating, with the median ratio.

    .venv/bin/python docs/benchmarks/core_process.py [--model smollm2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from pagoda import LLM, SamplingParams


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    inproc = LLM(args.model)
    apart = LLM(args.model, core_process=True)
    core = apart.engine.core
    for _ in range(50):
        core.has_unfinished_requests()
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        core.has_unfinished_requests()
    print(f"empty call round trip: {(time.perf_counter() - start) / n * 1e6:.0f} us")

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine = apart.engine
    for i in range(16):
        engine.add_request(f"size{i}", [1] + list(range(200, 231)), params)
    engine.step()
    step = core.step()
    print(f"one step's outputs at {len(step.outputs)} sequences: {len(pickle.dumps(step))} bytes pickled")
    for i in range(16):
        engine.abort_request(f"size{i}")

    for batch in (1, 16):
        prompts = [[1] + list(range(100 + i, 131 + i)) for i in range(batch)]
        timed_generate(inproc, prompts, params)
        timed_generate(apart, prompts, params)
        ratios, tokens = [], batch * args.output_len
        for _ in range(args.rounds):
            a = timed_generate(inproc, prompts, params)
            b = timed_generate(apart, prompts, params)
            ratios.append(b / a)
            print(f"  {batch:2d} streams: in process {tokens / a:6.1f} tok/s, core process {tokens / b:6.1f} tok/s")
        print(f"{batch:2d} streams: core process / in process time, median of {args.rounds}: "
              f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    apart.engine.shutdown()


if __name__ == "__main__":
    main()
