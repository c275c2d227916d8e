"""One TP/PP engine's steps: the bytes each step sends to the workers and brings back, and the
time of a greedy and of a seeded sampled generation.

    .venv/bin/python docs/benchmarks/parallel_step.py [--model smollm2] [-pp 2] [-tp 1] [--rounds 3]

Runs from any commit (it wraps the executor's `send` and `receive`), so two commits can be
compared by running it from a worktree of each, alternating.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from pagoda import LLM, SamplingParams, executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size)
    sizes: dict[str, list[int]] = {"sent": [], "back": []}
    real_send, real_receive = executor.send, executor.receive

    def send(conn, obj):  # noqa: ANN001, ANN202
        sizes["sent"].append(len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))
        return real_send(conn, obj)

    def receive(conn):  # noqa: ANN001, ANN202
        obj = real_receive(conn)
        sizes["back"].append(len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))
        return obj

    executor.send, executor.receive = send, receive  # type: ignore[assignment]
    prompts = [[1] + list(range(100 + i, 131 + i)) for i in range(args.streams)]
    cases = {"greedy": SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
             "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=64,
                                      ignore_eos=True)}
    llm.generate(prompts[:2], cases["greedy"], use_tqdm=False)
    for name, params in cases.items():
        times = []
        for _ in range(args.rounds):
            sizes["sent"].clear()
            sizes["back"].clear()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        # NOTE: the decode steps: every one of the streams samples.
        sent, back = statistics.median(sizes["sent"]), statistics.median(sizes["back"])
        print(f"{name}: {args.streams} streams x 64 tokens, median of {args.rounds}: "
              f"{statistics.median(times):.2f} s (range {min(times):.2f}-{max(times):.2f}); "
              f"a step's median bytes: sent {sent:,.0f}, back {back:,.0f}")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
