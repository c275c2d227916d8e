"""`pagoda bench spec-decode`: what speculative decoding buys, and where it does not.

Two workloads, each run with and without `--speculative-config` on the same engine settings:
- grounded, single stream: answers that copy their input, as editing and quoting do (rewrite
  a standard-library function with one name changed; quote a passage of Python's own help
  text, `pydoc_data.topics`; no download); greedy, one request at a time;
- random, `--concurrency` streams: random prompts, 128 tokens forced, all at once, to check
  that drafting costs nothing where it cannot help (switch it off there with
  `disable_by_batch_size`).
It reports output tok/s of each run, the speed-up, and the draft acceptance rate.
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap
import time
from typing import Any

import torch

from pagoda.metrics.base import StatLoggerBase
from pagoda.sampling_params import SamplingParams
from pagoda.stats import IterationStats, SchedulerStats


class AcceptanceLogger(StatLoggerBase):
    """Counts drafted and accepted tokens."""

    def __init__(self) -> None:
        self.draft_tokens = self.accepted = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        spec = iteration_stats.spec_decoding if iteration_stats else None
        if spec is not None:
            self.draft_tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens

    def log(self) -> None:
        """Nothing periodic."""


def add_spec_decode_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="auto")
    add("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    add("--concurrency", type=int, default=16)
    add("--max-tokens", type=int, default=256, help="grounded answers' token cap")
    add("--output-json", default=None)


def grounded_questions() -> list[str]:
    """Questions whose answers copy long spans of the question."""
    from pydoc_data.topics import topics

    code = textwrap.dedent(inspect.getsource(textwrap.indent))
    questions = [f"Rewrite this Python function, renaming the parameter `prefix` to `margin`. "
                 f"Output only the full code.\n\n```python\n{code}```"]
    for topic in ("assert", "pass", "del"):
        passage = " ".join(topics[topic].split())[:700]
        questions.append(f"Quote the following passage word for word:\n\n{passage}")
    return questions


def _chat(llm: Any, question: str) -> list[int]:
    return list(llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))


def single_stream(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, elapsed = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
    return tokens / elapsed


def batched(llm: Any, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _measure(args: argparse.Namespace, speculative: str | None) -> dict[str, float]:
    from pagoda import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048,
              **({"speculative_config": speculative} if speculative else {}))
    acceptance = AcceptanceLogger()
    llm.engine.stat_loggers.append(acceptance)
    grounded = [_chat(llm, q) for q in grounded_questions()]
    g = torch.Generator().manual_seed(0)
    random_prompts = [torch.randint(100, 40000, (128,), generator=g).tolist()
                      for _ in range(args.concurrency)]
    single_stream(llm, grounded[:1], 16)  # NOTE: warm-up
    result = {"grounded_c1_tok_s": single_stream(llm, grounded, args.max_tokens)}
    grounded_acceptance = acceptance.accepted / max(acceptance.draft_tokens, 1)
    result[f"random_c{args.concurrency}_tok_s"] = batched(llm, random_prompts)
    if speculative:
        result["grounded_acceptance_rate"] = grounded_acceptance
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    base = _measure(args, None)
    spec = _measure(args, args.speculative_config)
    result: dict[str, Any] = {"model": args.model, "speculative_config": json.loads(
        args.speculative_config), "without": base, "with": spec}
    for key in base:
        result[f"speedup_{key.removesuffix('_tok_s')}"] = round(spec[key] / base[key], 3)
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
