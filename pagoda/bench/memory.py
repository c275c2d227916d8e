"""`pagoda bench memory`: the "memory tetris" replay.

A workload's (prompt length, output length) pairs are replayed step by step against one KV
pool of fixed size under three policies:
- paged: pagoda's `BlockManager` hands out blocks as tokens arrive; when a running request
  cannot grow, the newest one is preempted (freed and later recomputed), like the scheduler;
- contiguous-max: each request reserves max_model_len slots up front (static-batch servers);
- contiguous-exact: each request reserves prompt + max_tokens slots up front (an oracle).
Each step, every running request computes its pending tokens and samples one; a request is
admitted (first come, first served) when its reservation fits. Held = slots reserved, used =
slots holding a computed token's KV, wasted = held - used. There is no token budget: the
replay measures memory, not compute. The paged pool's held blocks are cross-checked each
step against the analytic count sum(ceil(computed tokens / block_size)).
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagoda.block_manager import BlockManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

POLICIES = ("paged", "contiguous-max", "contiguous-exact")
# NOTE: SmolLM2-135M in bf16: 30 layers x (K + V) x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


@dataclass
class ReplayTrace:
    """Per-step series of one policy's replay (all in token slots)."""

    policy: str
    capacity: int
    held: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    analytic_held: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.batch)

    @property
    def wasted(self) -> list[int]:
        return [h - u for h, u in zip(self.held, self.used, strict=True)]

    def summary(self) -> dict[str, float | int | str]:
        steps = max(self.num_steps, 1)
        held = sum(self.held)
        return {
            "policy": self.policy,
            "steps": self.num_steps,
            "max_batch": max(self.batch, default=0),
            "mean_batch": sum(self.batch) / steps,
            "mean_held_tokens": held / steps,
            "mean_used_tokens": sum(self.used) / steps,
            "peak_held_tokens": max(self.held, default=0),
            "wasted_pct_of_held": 100.0 * sum(self.wasted) / held if held else 0.0,
            "preemptions": self.num_preemptions,
        }


class _Seq:
    """A replayed request: its lengths and how far it has got."""

    def __init__(self, index: int, prompt_len: int, output_len: int) -> None:
        self.request = Request(f"r{index}", [0] * prompt_len,
                               SamplingParams(max_tokens=output_len, ignore_eos=True))
        self.output_len = output_len

    @property
    def pending(self) -> int:
        return self.request.num_tokens - self.request.num_computed_tokens

    def step(self) -> bool:
        """Computes the pending tokens, samples one; returns True when finished."""
        req = self.request
        req.num_computed_tokens = req.num_tokens
        req.append_token(0)
        return req.num_output_tokens >= self.output_len


def _check_lengths(lengths: list[tuple[int, int]], capacity: int) -> None:
    for prompt_len, output_len in lengths:
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"lengths must be positive, got ({prompt_len}, {output_len}).")
        if prompt_len + output_len > capacity:
            raise ValueError(f"a request of {prompt_len}+{output_len} tokens cannot fit in a "
                             f"pool of {capacity} slots.")


def replay_paged(lengths: list[tuple[int, int]], num_blocks: int, block_size: int,
                 max_num_seqs: int = 256) -> ReplayTrace:
    """Replays `lengths` through the block allocator, preempting the newest when it runs dry."""
    capacity = num_blocks * block_size
    _check_lengths(lengths, capacity)
    pool = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    trace = ReplayTrace("paged", capacity)
    waiting = deque(_Seq(i, p, o) for i, (p, o) in enumerate(lengths))
    running: list[_Seq] = []
    while waiting or running:
        # NOTE: like the scheduler, a step that had to preempt admits nobody new.
        if not _grow_running(pool, running, waiting, trace):
            while waiting and len(running) < max_num_seqs:
                if not pool.allocate_slots(waiting[0].request, waiting[0].pending):
                    break
                running.append(waiting.popleft())
        _record_paged(pool, running, trace)
        running = [s for s in running if not _finish(s, pool)]
    return trace


def _grow_running(pool: BlockManager, running: list[_Seq], waiting: deque[_Seq],
                  trace: ReplayTrace) -> bool:
    """Gives each running request slots for its pending token, preempting the newest.

    Returns whether anything was preempted.
    """
    before = trace.num_preemptions
    i = 0
    while i < len(running):
        seq = running[i]
        if pool.allocate_slots(seq.request, seq.pending):
            i += 1
            continue
        victim = running.pop()
        pool.free(victim.request)
        victim.request.num_computed_tokens = 0
        waiting.appendleft(victim)
        trace.num_preemptions += 1
    return trace.num_preemptions > before


def _record_paged(pool: BlockManager, running: list[_Seq], trace: ReplayTrace) -> None:
    bs = pool.block_size
    tokens = [s.request.num_tokens for s in running]
    trace.held.append((pool.num_blocks - pool.num_free_blocks) * bs)
    trace.used.append(sum(tokens))
    trace.batch.append(len(running))
    trace.analytic_held.append(sum(-(-t // bs) * bs for t in tokens))


def _finish(seq: _Seq, pool: BlockManager) -> bool:
    if seq.step():
        pool.free(seq.request)
        return True
    return False


def replay_contiguous(lengths: list[tuple[int, int]], capacity: int,
                      max_model_len: int | None, max_num_seqs: int = 256) -> ReplayTrace:
    """Replays `lengths` with up-front reservations: max_model_len each, or (None) exactly
    prompt + output length each."""
    policy = "contiguous-exact" if max_model_len is None else "contiguous-max"
    _check_lengths(lengths, capacity if max_model_len is None else min(capacity, max_model_len))
    trace = ReplayTrace(policy, capacity)
    waiting = deque(_Seq(i, p, o) for i, (p, o) in enumerate(lengths))
    running: list[tuple[_Seq, int]] = []
    free = capacity
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            seq = waiting[0]
            reserve = max_model_len or seq.request.num_prompt_tokens + seq.output_len
            if reserve > free:
                break
            running.append((waiting.popleft(), reserve))
            free -= reserve
        trace.held.append(capacity - free)
        trace.used.append(sum(s.request.num_tokens for s, _ in running))
        trace.batch.append(len(running))
        trace.analytic_held.append(capacity - free)
        still_running = []
        for seq, reserve in running:
            if seq.step():
                free += reserve
            else:
                still_running.append((seq, reserve))
        running = still_running
    return trace


def replay_all(lengths: list[tuple[int, int]], num_blocks: int, block_size: int,
               max_model_len: int, max_num_seqs: int = 256) -> list[ReplayTrace]:
    """The three policies on one pool of num_blocks * block_size slots."""
    capacity = num_blocks * block_size
    return [replay_paged(lengths, num_blocks, block_size, max_num_seqs),
            replay_contiguous(lengths, capacity, max_model_len, max_num_seqs),
            replay_contiguous(lengths, capacity, None, max_num_seqs)]


def format_report(traces: list[ReplayTrace], bytes_per_token: int) -> str:
    """A text table: steps, batch, held/used/wasted memory per policy."""
    mib = bytes_per_token / 2**20
    header = (f"{'policy':<18}{'steps':>7}{'max batch':>11}{'mean batch':>12}"
              f"{'held MiB':>10}{'used MiB':>10}{'wasted %':>10}{'preempt':>9}")
    lines = [header, "-" * len(header)]
    for trace in traces:
        s = trace.summary()
        lines.append(f"{trace.policy:<18}{s['steps']:>7}{s['max_batch']:>11}"
                     f"{s['mean_batch']:>12.1f}{float(s['mean_held_tokens']) * mib:>10.1f}"
                     f"{float(s['mean_used_tokens']) * mib:>10.1f}"
                     f"{s['wasted_pct_of_held']:>10.1f}{s['preemptions']:>9}")
    return "\n".join(lines)


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--num-prompts", type=int, default=64)
    add("--input-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    add("--output-len-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    add("--seed", type=int, default=0)
    add("--result-file", default=None,
        help="Replay the input_lens/output_lens of a `bench serve` result JSON instead.")
    add("--num-blocks", type=int, default=256, help="KV pool size in blocks.")
    add("--block-size", type=int, default=16)
    add("--max-model-len", type=int, default=2048, help="What contiguous-max reserves.")
    add("--max-num-seqs", type=int, default=256)
    add("--kv-bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
        help="Default: SmolLM2-135M in bf16 (23,040 bytes).")
    add("--output-dir", default="results/memory", help="Where memory.png/json go.")


def workload_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(prompt, output) lengths: from a serve result (successful requests) or seeded random."""
    if args.result_file:
        result = json.loads(Path(args.result_file).read_text(encoding="utf-8"))
        pairs = zip(result["input_lens"], result["output_lens"], strict=True)
        return [(int(i), int(o)) for i, o in pairs if int(i) > 0 and int(o) > 0]
    rng = np.random.default_rng(args.seed)
    ins = rng.integers(args.input_len_range[0], args.input_len_range[1] + 1, args.num_prompts)
    outs = rng.integers(args.output_len_range[0], args.output_len_range[1] + 1, args.num_prompts)
    return [(int(i), int(o)) for i, o in zip(ins, outs, strict=True)]


def main(args: argparse.Namespace) -> list[ReplayTrace]:
    """The `bench memory` handler: replay, print the table, write memory.png and .json."""
    from pagoda.bench.plots import plot_memory

    lengths = workload_lengths(args)
    traces = replay_all(lengths, args.num_blocks, args.block_size, args.max_model_len,
                        args.max_num_seqs)
    paged = traces[0]
    capacity = paged.capacity
    print(f"Workload: {len(lengths)} requests; pool: {args.num_blocks} blocks x "
          f"{args.block_size} tokens = {capacity} token slots "
          f"({capacity * args.kv_bytes_per_token / 2**20:.1f} MiB)")
    print(format_report(traces, args.kv_bytes_per_token))
    print(f"Allocator matches the analytic block count at every step: "
          f"{paged.held == paged.analytic_held}")
    out = Path(args.output_dir)
    png = plot_memory(traces, args.kv_bytes_per_token, out / "memory.png")
    payload = {"lengths": lengths, "num_blocks": args.num_blocks,
               "block_size": args.block_size, "max_model_len": args.max_model_len,
               "kv_bytes_per_token": args.kv_bytes_per_token,
               "policies": [t.summary() for t in traces]}
    (out / "memory.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    print(f"Wrote {png} and {out / 'memory.json'}")
    return traces
