"""`pagoda bench structured`: what JSON-constrained decoding costs.

Offline, on one engine: the same chat prompts run with every request under a JSON schema and
then free (`--concurrency` sequences at a time), each free request forced to the length its
constrained twin produced, so both runs decode the same number of tokens; the pair repeats
`--repeats` times so that machine noise hits both alike. It reports output tok/s of each and
their ratio, and the grammar work a request pays before its first token: compiling and
computing the first mask, cold (a schema never seen) and cached (the same schema again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import GrammarCompiler, StructuredOutputsParams

PROPERTIES: dict[str, Any] = {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}}
SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": False,
                          "required": ["name", "age", "city", "hobbies"], "properties": PROPERTIES}
TOPICS = ["a chef", "a pilot", "a painter", "a farmer", "a teacher", "an astronaut",
          "a doctor", "a musician"]


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="auto")
    add("--num-prompts", type=int, default=64)
    add("--concurrency", type=int, default=16, help="sequences decoding at once")
    add("--max-tokens", type=int, default=128)
    add("--repeats", type=int, default=2)
    add("--output-json", default=None)


def _run(llm: Any, prompts: list[str], params: SamplingParams | list[SamplingParams]
         ) -> tuple[float, list[int]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [len(o.outputs[0].token_ids) for o in outs]


def compile_times(tokenizer: Any, vocab_size: int) -> dict[str, float]:
    """Milliseconds from a schema to its first token mask: cold (new) and cached (seen)."""
    import torch

    compiler = GrammarCompiler(tokenizer, vocab_size)
    compiler.compile(StructuredOutputsParams(json_object=True))  # NOTE: the tokenizer, once
    row = torch.empty(-(-vocab_size // 32), dtype=torch.int32)
    cold: list[float] = []
    cached: list[float] = []
    for i in range(8):
        properties = {**PROPERTIES, f"extra{i}": {"type": "number"}}
        schema = {**SCHEMA, "properties": properties}
        so = StructuredOutputsParams(json=schema)
        for times in (cold, cached):
            t0 = time.perf_counter()
            compiler.compile(so).fill_bitmask(row)
            times.append(time.perf_counter() - t0)
    return {"first_mask_cold_ms": 1e3 * statistics.median(cold),
            "first_mask_cached_ms": 1e3 * statistics.median(cached)}


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency)
    prompts = [str(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object "
                                     "with name, age, city and hobbies."}],
        add_generation_prompt=True, tokenize=False)) for i in range(args.num_prompts)]
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    _run(llm, prompts[:args.concurrency], constrained)  # NOTE: warm-up, grammar tokenizer
    rates: dict[str, list[float]] = {"free": [], "json": []}
    for _ in range(args.repeats):
        elapsed, lengths = _run(llm, prompts, constrained)
        rates["json"].append(sum(lengths) / elapsed)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        elapsed, free_lengths = _run(llm, prompts, free)
        rates["free"].append(sum(free_lengths) / elapsed)
    result: dict[str, Any] = {
        "model": args.model, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
        "free_output_tok_s": round(statistics.median(rates["free"]), 1),
        "json_output_tok_s": round(statistics.median(rates["json"]), 1),
        **{k: round(v, 2) for k, v in compile_times(llm.tokenizer,
                                                     llm.engine.processor.vocab_size).items()},
    }
    result["json_vs_free"] = round(result["json_output_tok_s"] / result["free_output_tok_s"], 3)
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
