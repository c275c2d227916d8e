"""`pagoda bench prefix-caching`: time to first token with a shared system prompt, cold vs warm.

Each round builds a fresh ~1,000-token system prompt (through the chat template) and sends,
one request at a time, a cold request (nothing cached) and then --num-warm requests with
other questions, which can reuse the system prompt's KV. TTFT is the engine's own
`first_token_time - arrival_time`. The same requests then run on an engine with prefix
caching off (the baseline). The figure of merit is median warm TTFT / median cold TTFT; the
issue asks for at most 0.5. Both engines first serve an unrelated prompt of the same length
so that one-time kernel set-up is not charged to the cold request.

    python -m pagoda.bench.prefix_caching --save-result results/prefix_caching.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# NOTE: OpenMP spin-waiting on shared cores slows torch 5-10x; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGET_RATIO = 0.5
TOPICS = ["billing", "refunds", "shipping", "passwords", "warranties", "upgrades", "privacy",
          "invoices", "outages", "accessibility", "gift cards", "data exports", "cancellations"]
TONES = ["briefly", "politely", "step by step", "with an example", "in plain words",
         "with a short checklist", "without jargon"]
DETAILS = ["the help centre link", "the ticket number", "the expected delay", "the account page",
           "the relevant policy section", "a follow-up date", "the escalation path",
           "the price in euros", "the opening hours", "the region it applies to", "a safety note"]
QUESTIONS = [
    "How do I reset my password?", "Can I get a refund for a late parcel?",
    "What does the premium upgrade include?", "How long does shipping to Norway take?",
    "Where can I download my invoices?", "Is my warranty still valid after two years?",
    "How do I export all my data?", "Why was my card charged twice?",
    "Can I cancel my subscription mid-month?", "Do gift cards expire?",
    "What happens to my data when I close my account?", "Is the service down right now?",
]


@dataclass
class Measurement:
    """One request: its role, prompt length, cached tokens and time to first token."""

    mode: str
    round: int
    kind: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class PrefixCachingResult:
    """Every measurement plus the medians the issue's criterion uses."""

    shared_prefix_tokens: int
    measurements: list[Measurement] = field(default_factory=list)

    def ttfts(self, mode: str, kind: str) -> list[float]:
        return [m.ttft_s for m in self.measurements if m.mode == mode and m.kind == kind]

    def summary(self) -> dict[str, float]:
        cold = statistics.median(self.ttfts("caching", "cold"))
        warm = statistics.median(self.ttfts("caching", "warm"))
        base = [m.ttft_s for m in self.measurements if m.mode == "baseline" and m.kind != "warmup"]
        out = {"median_cold_ttft_s": cold, "median_warm_ttft_s": warm, "warm_over_cold": warm / cold}
        if base:
            out["median_baseline_ttft_s"] = statistics.median(base)
            out["warm_over_baseline"] = warm / out["median_baseline_ttft_s"]
        return out


def add_prefix_caching_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    add("--system-prompt-len", type=int, default=1000,
        help="Tokens of the shared system prompt (chat template included), about.")
    add("--num-warm", type=int, default=4, help="Warm requests per round, one at a time.")
    add("--num-rounds", type=int, default=2, help="Rounds, each with a fresh system prompt.")
    add("--max-tokens", type=int, default=4)
    add("--block-size", type=int, default=16)
    add("--kv-cache-memory", default="512MiB")
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--no-baseline", dest="baseline", action="store_false",
        help="Skip the run with prefix caching off.")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="--no-enable-prefix-caching measures only the baseline.")
    add("--save-result", default=None, metavar="PATH", help="Write the results here as JSON.")


def add_prefix_caching_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the `prefix-caching` sub-command to an argparse subparsers object."""
    help_text = "TTFT of requests sharing a ~1,000-token system prompt, cold vs warm."
    parser = subparsers.add_parser("prefix-caching", help=help_text, description=help_text)
    add_prefix_caching_args(parser)
    parser.set_defaults(func=_handle)
    return parser


# ---- the workload ------------------------------------------------------------------------
def system_prompt(tokenizer: Any, num_tokens: int, variant: int) -> str:
    """Varied support-desk rules until the templated system turn reaches `num_tokens`."""
    # NOTE: the variant comes first so that rounds share no block with each other.
    lines = [f"#{variant}: you are the support assistant of Pagoda Shop. Follow these rules."]
    i = 0
    while len(_template(tokenizer, "\n".join(lines), None)) < num_tokens:
        lines.append(f"Rule {i + 1}: when a customer asks about {TOPICS[(i + variant) % len(TOPICS)]}, "
                     f"answer {TONES[(3 * i + variant) % len(TONES)]} and mention "
                     f"{DETAILS[(7 * i + 2 * variant) % len(DETAILS)]}.")
        i += 1
    return "\n".join(lines)


def _template(tokenizer: Any, system: str, question: str | None) -> list[int]:
    messages = [{"role": "system", "content": system}]
    if question is not None:
        messages.append({"role": "user", "content": question})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=question is not None,
                                              tokenize=True, return_dict=False))


def round_prompts(tokenizer: Any, num_tokens: int, variant: int, num_warm: int) -> list[list[int]]:
    """One round: [cold, warm 1..num_warm], all with the same system prompt."""
    system = system_prompt(tokenizer, num_tokens, variant)
    questions = [QUESTIONS[(variant + k) % len(QUESTIONS)] for k in range(num_warm + 1)]
    return [_template(tokenizer, system, q) for q in questions]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- measuring ---------------------------------------------------------------------------
def make_llm(args: argparse.Namespace, mode: str) -> Any:
    from pagoda import LLM

    return LLM(args.model, dtype=args.dtype, block_size=args.block_size,
               kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=mode == "caching",
               max_num_batched_tokens=args.max_num_batched_tokens)


def measure(llm: Any, mode: str, rounds: list[list[list[int]]], warmup: list[int],
            max_tokens: int) -> list[Measurement]:
    """Sends the warm-up, then every round's requests, one at a time."""
    results = [_one(llm, warmup, max_tokens, mode, -1, "warmup")]
    for r, prompts in enumerate(rounds):
        for k, prompt in enumerate(prompts):
            results.append(_one(llm, prompt, max_tokens, mode, r, "cold" if k == 0 else "warm"))
            print(_row(results[-1]), flush=True)
    llm.engine.check_integrity()
    return results


def _one(llm: Any, prompt: list[int], max_tokens: int, mode: str, round_index: int,
         kind: str) -> Measurement:
    from pagoda import SamplingParams

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time
    return Measurement(mode, round_index, kind, len(prompt), out.num_cached_tokens, ttft)


def run(args: argparse.Namespace) -> PrefixCachingResult:
    """Runs the benchmark, prints the table and the ratio, saves JSON when asked."""
    modes = (["caching"] if args.enable_prefix_caching else []) + (["baseline"] if args.baseline else [])
    if not modes:
        raise ValueError("Nothing to measure: --no-enable-prefix-caching with --no-baseline.")
    if args.num_warm < 1 or args.num_rounds < 1:
        raise ValueError(f"--num-warm and --num-rounds must be >= 1, got {args.num_warm}, "
                         f"{args.num_rounds}.")
    rounds: list[list[list[int]]] = []
    warmup: list[int] = []
    measurements: list[Measurement] = []
    for mode in modes:
        llm = make_llm(args, mode)
        if not rounds:
            rounds = [round_prompts(llm.tokenizer, args.system_prompt_len, v, args.num_warm)
                      for v in range(args.num_rounds)]
            # NOTE: another system prompt of the same length warms the kernels up.
            warmup = round_prompts(llm.tokenizer, args.system_prompt_len, args.num_rounds + 7, 0)[0]
            print(_header())
        measurements += measure(llm, mode, rounds, warmup, args.max_tokens)
        del llm
    result = PrefixCachingResult(common_prefix_len(rounds[0][0], rounds[0][-1]), measurements)
    print(format_summary(result))
    if args.save_result:
        save(args, result)
    return result


# ---- reporting ---------------------------------------------------------------------------
def _header() -> str:
    return f"{'mode':<9}{'round':>6}  {'request':<8}{'prompt':>8}{'cached':>8}{'TTFT ms':>10}"


def _row(m: Measurement) -> str:
    return (f"{m.mode:<9}{m.round:>6}  {m.kind:<8}{m.prompt_tokens:>8}{m.cached_tokens:>8}"
            f"{m.ttft_s * 1000:>10.1f}")


def format_summary(result: PrefixCachingResult) -> str:
    lines = [f"shared prefix: {result.shared_prefix_tokens} tokens"]
    if not result.ttfts("caching", "cold"):
        base = result.ttfts("baseline", "cold") + result.ttfts("baseline", "warm")
        return "\n".join(lines + [f"baseline median TTFT: {statistics.median(base) * 1000:.1f} ms"])
    s = result.summary()
    lines.append(f"median TTFT cold {s['median_cold_ttft_s'] * 1000:.1f} ms, "
                 f"warm {s['median_warm_ttft_s'] * 1000:.1f} ms")
    if "median_baseline_ttft_s" in s:
        lines.append(f"median TTFT without prefix caching {s['median_baseline_ttft_s'] * 1000:.1f} ms")
    verdict = "met" if s["warm_over_cold"] <= TARGET_RATIO else "NOT met"
    lines.append(f"warm / cold TTFT: {s['warm_over_cold']:.3f} (target <= {TARGET_RATIO}: {verdict})")
    return "\n".join(lines)


def save(args: argparse.Namespace, result: PrefixCachingResult) -> None:
    from pagoda.bench.throughput import environment

    payload = {
        "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "environment": {**environment(), "loadavg": os.getloadavg()},
        "shared_prefix_tokens": result.shared_prefix_tokens,
        "summary": result.summary() if result.ttfts("caching", "cold") else {},
        "measurements": [asdict(m) for m in result.measurements],
    }
    path = Path(args.save_result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    print(f"Saved results to {path}")


def _handle(args: argparse.Namespace) -> int:
    start = time.time()
    run(args)
    print(f"[{time.time() - start:.1f} s]")
    return 0


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """`python -m pagoda.bench.prefix_caching [flags]`; also accepts parsed args."""
    if isinstance(argv, argparse.Namespace):
        return _handle(argv)
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench.prefix_caching",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    add_prefix_caching_args(parser)
    return _handle(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
