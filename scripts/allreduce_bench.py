"""All-reduce time over gloo on this machine (docs/scaling.md), for tensor parallelism.

Starts WORLD processes on loopback; each all-reduces a [tokens, hidden] tensor (the size a
row-parallel layer sums: one per attention and one per MLP, per layer and step) REPEATS
times; prints the median time per call for each size.

Usage: .venv/bin/python scripts/allreduce_bench.py [--world 2 3] [--hidden 576]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = (1, 16, 64, 256, 2048)


def run(rank: int, world: int, port: int, hidden: int, repeats: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        result[tokens] = statistics.median(times) * 1e6
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    out = {}
    for world in args.world:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue: mp.Queue = mp.get_context("spawn").Queue()
        mp.spawn(run, (world, port, args.hidden, args.repeats, queue), nprocs=world)
        out[world] = queue.get()
    print(f"| tokens x hidden {args.hidden} (bf16) | bytes | " +
          " | ".join(f"world {w}: us" for w in out) + " |")
    print("|---|---|" + "---|" * len(out))
    for tokens in TOKENS:
        print(f"| {tokens} | {tokens * args.hidden * 2:,} | " +
              " | ".join(f"{out[w][tokens]:.0f}" for w in out) + " |")
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
