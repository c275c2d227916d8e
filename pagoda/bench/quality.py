"""`pagoda bench quality`: what quantization and an fp8 KV cache cost in quality.

Two figures per scheme, both against the unquantized model in the same dtype:
- perplexity over held-out text that ships with Python (`pydoc_data.topics`, Python's own
  documentation: nothing to download, never seen as a prompt here). Windows of --window
  tokens are prefilled in chunks of --chunk tokens through the engine's paged pool, so every
  chunk after the first reads its context from the KV cache (an fp8 pool included);
- greedy agreement: each of --num-prompts prompts (other passages of the same text) is
  continued greedily for --max-tokens tokens; the first position where a scheme's tokens
  depart from the reference's (max-tokens when they never do), averaged over the prompts.
Schemes: `bf16` (the reference: the model as pagoda serves it without flags), `int8`, `int4`
(group 32), `int4-g64`, `int4-g128`, `gguf` (a quantized GGUF's blocks kept packed),
`kv-fp8` (e4m3 KV cache), `kv-fp8_e5m2`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

SCHEME_ARGS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
    "gguf": {"quantization": "gguf"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
}
REFERENCE = "bf16"


@dataclass
class QualityResult:
    scheme: str
    perplexity: float
    perplexity_ratio: float  # against the reference's
    mean_first_divergence: float
    num_prompts: int
    max_tokens: int
    num_ppl_tokens: int
    seconds: float


def held_out_ids(tokenizer: Any) -> list[int]:
    """Python's documentation topics, in a fixed order, as token ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def perplexity(llm: Any, ids: list[int], num_windows: int, window: int, chunk: int) -> tuple[float, int]:
    """exp(mean NLL) of the next token over `num_windows` consecutive windows; (ppl, tokens)."""
    from pagoda.request import Request
    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduler import SchedulerOutput

    runner = llm.engine.runner
    block_size = runner.block_size
    nll, count = 0.0, 0
    for w in range(num_windows):
        tokens = ids[w * window:(w + 1) * window]
        request = Request(f"ppl-{w}", tokens, SamplingParams(max_tokens=1))
        request.block_ids = list(range(-(-len(tokens) // block_size)))
        for start in range(0, len(tokens) - 1, chunk):
            n = min(chunk, len(tokens) - start)
            step = SchedulerOutput()
            step.add(request, n)
            _, inputs = runner.preparer.prepare(step)
            inputs.logits_rows = torch.arange(n, device=runner.device)
            logits = runner.logits(inputs).float()
            targets = torch.tensor(tokens[start + 1:start + n + 1], device=logits.device)
            logp = torch.log_softmax(logits[:len(targets)], dim=-1)
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += len(targets)
            request.num_computed_tokens += n
    return float(torch.exp(torch.tensor(nll / count))), count


def prompt_set(ids: list[int], num_prompts: int, prompt_len: int, skip: int) -> list[list[int]]:
    """Passages after the perplexity windows (`skip` tokens), evenly spaced."""
    rest = ids[skip:]
    stride = max(len(rest) // max(num_prompts, 1), prompt_len)
    return [rest[i * stride:i * stride + prompt_len] for i in range(num_prompts)]


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def evaluate(model: str, schemes: list[str], dtype: str = "bfloat16", num_windows: int = 4,
             window: int = 1024, chunk: int = 128, num_prompts: int = 16, prompt_len: int = 32,
             max_tokens: int = 64, engine_args: dict[str, Any] | None = None) -> list[QualityResult]:
    """Each scheme's perplexity and greedy agreement against the reference (run first)."""
    from pagoda.llm import LLM

    results: list[QualityResult] = []
    reference: tuple[float, list[list[int]]] | None = None
    ids: list[int] = []
    prompts: list[list[int]] = []
    for scheme in [REFERENCE, *[s for s in schemes if s != REFERENCE]]:
        started = time.perf_counter()
        # NOTE: `perplexity` fills one block table itself: one KV cache group.
        llm = LLM(model, dtype=dtype, enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True,
                  **(engine_args or {}), **SCHEME_ARGS[scheme])
        if not ids:
            ids = held_out_ids(llm.tokenizer)
            prompts = prompt_set(ids, num_prompts, prompt_len, num_windows * window)
        ppl, count = perplexity(llm, ids, num_windows, window, chunk)
        outs = greedy(llm, prompts, max_tokens)
        if reference is None:
            reference = (ppl, outs)
        agreement = sum(first_divergence(o, r) for o, r in zip(outs, reference[1], strict=True)) / len(outs)
        results.append(QualityResult(scheme, ppl, ppl / reference[0], agreement, len(prompts), max_tokens,
                                     count, time.perf_counter() - started))
        del llm
    return [r for r in results if r.scheme in schemes]


def format_results(results: list[QualityResult]) -> str:
    lines = [f"{'scheme':12s} {'perplexity':>10s} {'vs ref':>8s} {'first divergence':>17s}"]
    for r in results:
        lines.append(f"{r.scheme:12s} {r.perplexity:10.3f} {100 * (r.perplexity_ratio - 1):+7.2f}% "
                     f"{r.mean_first_divergence:8.1f} / {r.max_tokens}")
    return "\n".join(lines)


def add_quality_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add("--schemes", nargs="+", default=list(SCHEME_ARGS), choices=list(SCHEME_ARGS))
    add("--num-windows", type=int, default=4)
    add("--window", type=int, default=1024, help="Tokens per perplexity window.")
    add("--chunk", type=int, default=128, help="Prefill chunk: later chunks read the KV cache.")
    add("--num-prompts", type=int, default=16)
    add("--prompt-len", type=int, default=32)
    add("--max-tokens", type=int, default=64)
    add("--output-json", default=None)


def main(args: argparse.Namespace) -> list[QualityResult]:
    """The `bench quality` handler."""
    results = evaluate(args.model, args.schemes, args.dtype, args.num_windows, args.window, args.chunk,
                       args.num_prompts, args.prompt_len, args.max_tokens)
    print(format_results(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results
