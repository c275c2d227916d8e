"""`pagoda bench memory`: the replay on small traces worked out by hand."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagoda.bench.cli import add_bench_parser, run_command
from pagoda.bench.memory import replay_all, replay_contiguous, replay_paged


def test_paged_replay_matches_hand_computed_trace() -> None:
    # block 4, pool 4 blocks; A=(3 prompt, 2 out), B=(5, 3), C=(6, 1).
    # step 0: A 1 block + B 2 blocks, C does not fit; step 1: A finishes; step 2: C fits.
    trace = replay_paged([(3, 2), (5, 3), (6, 1)], num_blocks=4, block_size=4)
    assert trace.held == [12, 12, 16]
    assert trace.used == [8, 10, 13]
    assert trace.batch == [2, 2, 2]
    assert trace.analytic_held == trace.held
    assert trace.num_preemptions == 0


def test_paged_replay_preempts_the_newest_and_recomputes_it() -> None:
    # pool 3 blocks of 4: both 4-token prompts fit, both need a 2nd block at step 1, only
    # one is left: B (the newest) is preempted and returns with prompt + 1 output token.
    trace = replay_paged([(4, 5), (4, 5)], num_blocks=3, block_size=4)
    assert trace.num_preemptions == 1
    assert trace.batch == [2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert trace.used == [8, 5, 6, 7, 8, 5, 6, 7, 8]
    assert trace.held == [8] * 9
    assert trace.analytic_held == trace.held


def test_contiguous_replays_reserve_up_front() -> None:
    lengths = [(3, 2), (5, 3), (6, 1)]
    exact = replay_contiguous(lengths, capacity=16, max_model_len=None)
    assert exact.held == [13, 13, 15]
    assert exact.used == [8, 10, 13]
    assert exact.batch == [2, 2, 2]
    worst = replay_contiguous(lengths, capacity=16, max_model_len=12)
    assert worst.batch == [1] * 6
    assert worst.held == [12] * 6
    assert worst.used == [3, 4, 5, 6, 7, 6]


def test_summary_and_policies_on_a_random_workload() -> None:
    lengths = [(30 + 7 * i % 200, 10 + 13 * i % 150) for i in range(40)]
    paged, worst, exact = replay_all(lengths, num_blocks=128, block_size=16, max_model_len=1024)
    assert paged.analytic_held == paged.held
    for trace in (paged, worst, exact):
        assert all(u <= h <= trace.capacity for u, h in zip(trace.used, trace.held, strict=True))
        # every token of every request is computed once (plus recomputation after preemption)
        assert sum(trace.batch) >= sum(o for _, o in lengths)
    assert worst.summary()["max_batch"] == 2
    assert paged.summary()["max_batch"] > exact.summary()["max_batch"] > 2
    assert paged.summary()["wasted_pct_of_held"] < exact.summary()["wasted_pct_of_held"]


def test_request_larger_than_the_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        replay_paged([(60, 10)], num_blocks=4, block_size=16)


def test_memory_command_writes_png_and_json(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "memory", "--num-prompts", "16", "--num-blocks", "64",
                              "--max-model-len", "512", "--output-dir", str(tmp_path)])
    traces = run_command(args)
    assert [t.policy for t in traces] == ["paged", "contiguous-max", "contiguous-exact"]
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert (tmp_path / "memory.json").stat().st_size > 0
