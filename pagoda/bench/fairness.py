"""`pagoda bench fairness`: a probe's time to first token behind one request of many prompts.

One engine (the real default model unless --model), three runs of the same probe prompt:
alone (idle); after a batch of --num-prompts prompts sent as one request (one scheduling
group: the prompts take turns with other requests); and after the same batch sent as
separate requests (one group each: plain first come, first served, what pagoda did before
groups). The batch runs a few steps before the probe arrives, so every seat is taken. TTFT is
the engine's own `first_token_time - arrival_time`. Issue 23's figure of merit is the grouped
probe's TTFT against the idle one; the output tok/s of --throughput-requests prompts run to the
end is the price of the settings (--step-time-target-ms, --max-num-batched-tokens).

    pagoda bench fairness --num-prompts 1000 --save-result results/fairness.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

# NOTE: OpenMP spin-waiting on shared cores slows torch 5-10x; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROBE = "Write one sentence about the sea."


def add_fairness_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=1000, help="prompts in the batch request")
    parser.add_argument("--batch-max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--steps-before-probe", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--step-time-target-ms", type=float, default=None,
                        help="the scheduler's step time target (default: off, the fixed budget)")
    parser.add_argument("--skip-separate", action="store_true",
                        help="leave out the run with the batch as separate requests (~75 s)")
    parser.add_argument("--throughput-requests", type=int, default=128,
                        help="then this many prompts run to the end as separate requests, for "
                             "the output tok/s the settings give (0: skip)")
    parser.add_argument("--save-result", default=None, help="write the summary as JSON here")


def _engine(args: argparse.Namespace) -> Any:
    from pagoda.engine import LLMEngine

    return LLMEngine.from_engine_args(args.model, (), max_num_seqs=args.max_num_seqs, log_stats=False,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      step_time_target_ms=args.step_time_target_ms)


def _probe_ttft(engine: Any, batch: int, grouped: bool, max_tokens: int, steps_before: int) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = f"Item {i}: name a colour and a fruit."
        req = engine.processor.process(f"batch-{i}", prompt, params, group="batch" if grouped else None)
        engine.add_processed(req)
    for _ in range(steps_before if batch else 0):
        engine.step()
    engine.add_processed(engine.processor.process(
        "probe", PROBE, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "probe" and ttft is None and out.outputs[0].token_ids:
                ttft = out.metrics.first_token_time - out.metrics.arrival_time
        if ttft is not None:
            for i in range(batch):
                engine.abort_request(f"batch-{i}")
    assert ttft is not None
    return float(ttft)


def _throughput(engine: Any, num_requests: int, max_tokens: int) -> float:
    """Output tokens a second of `num_requests` prompts sent at once, run to the end."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        engine.add_processed(engine.processor.process(f"tput-{i}", f"Item {i}: name a colour and a fruit.", params))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return num_requests * max_tokens / (time.perf_counter() - start)


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda.bench.throughput import environment

    engine = _engine(args)
    _probe_ttft(engine, 0, True, args.batch_max_tokens, 0)  # NOTE: warm-up
    idle = _probe_ttft(engine, 0, True, args.batch_max_tokens, 0)
    grouped = _probe_ttft(engine, args.num_prompts, True, args.batch_max_tokens, args.steps_before_probe)
    separate = None if args.skip_separate else _probe_ttft(
        engine, args.num_prompts, False, args.batch_max_tokens, args.steps_before_probe)
    tput = _throughput(engine, args.throughput_requests, args.batch_max_tokens) if args.throughput_requests else None
    result = {"date": time.strftime("%Y-%m-%d"), "environment": environment(),
              "model": args.model, "num_prompts": args.num_prompts, "max_num_seqs": args.max_num_seqs,
              "batch_max_tokens": args.batch_max_tokens,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "step_time_target_ms": args.step_time_target_ms,
              "probe_ttft_idle_s": round(idle, 4), "probe_ttft_one_request_s": round(grouped, 4),
              "probe_ttft_separate_requests_s": None if separate is None else round(separate, 4),
              "one_request_over_idle": round(grouped / idle, 2),
              "throughput_requests": args.throughput_requests,
              "throughput_output_tok_s": None if tput is None else round(tput, 1)}
    print(json.dumps(result, indent=2))
    if args.save_result:
        Path(args.save_result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_result).write_text(json.dumps(result, indent=2) + "\n")
    engine.shutdown()
    return result
