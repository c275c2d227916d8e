"""Offline generation backends timed by `bench throughput` and `bench latency`.

Both take the same token-id prompts and force each output to its requested length (greedy,
EOS ignored), so they do the same useful work:
- pagoda: one `LLM.generate` call; the engine batches continuously.
- hf: plain transformers `generate` over static batches in input order, left-padded; a
  batch runs until its longest request is done. Padding and tokens generated past a
  request's own length are not useful and are not counted.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Backend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], output_lens: list[int],
                 use_tqdm: bool = False) -> int:
        """Generates output_lens[i] tokens after prompts[i]; returns the useful tokens made."""
        ...


class PagodaBackend:
    """pagoda's offline engine."""

    name = "pagoda"

    def __init__(self, model: str, dtype: str, engine_kwargs: dict[str, Any]) -> None:
        from pagoda import LLM

        self.llm = LLM(model=model, dtype=dtype, **engine_kwargs)

    def generate(self, prompts: list[list[int]], output_lens: list[int],
                 use_tqdm: bool = False) -> int:
        from pagoda import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
                  for n in output_lens]
        outputs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        made = [len(out.outputs[0].token_ids) for out in outputs]
        _check_lengths(self.name, made, output_lens)
        return sum(min(m, n) for m, n in zip(made, output_lens, strict=True))


class HFBackend:
    """transformers `generate` with static, left-padded batches."""

    name = "hf"

    def __init__(self, model: str, dtype: str, batch_size: int = 32) -> None:
        from pagoda.models.loader import load_hf_reference

        if batch_size < 1:
            raise ValueError(f"hf batch size must be at least 1, got {batch_size}.")
        self.model: Any = load_hf_reference(model, DTYPES[dtype])
        self.batch_size = batch_size
        self.pad_id = pad_token_id(self.model.config)

    def generate(self, prompts: list[list[int]], output_lens: list[int],
                 use_tqdm: bool = False) -> int:
        from tqdm import tqdm

        useful = 0
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            useful += self._generate_batch(prompts[start:end], output_lens[start:end])
            bar.update(len(prompts[start:end]))
        bar.close()
        return useful

    def _generate_batch(self, prompts: list[list[int]], output_lens: list[int]) -> int:
        from transformers import GenerationConfig

        input_ids, attention_mask = left_pad(prompts, self.pad_id)
        longest = max(output_lens)
        config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest,
                                  do_sample=False, pad_token_id=self.pad_id)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=config)
        made = out.shape[1] - input_ids.shape[1]
        _check_lengths(self.name, [made] * len(prompts), [longest] * len(prompts))
        return sum(output_lens)


def pad_token_id(config: Any) -> int:
    """The config's pad id, else its (first) EOS id, else 0."""
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos or 0)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _check_lengths(backend: str, made: list[int], wanted: list[int]) -> None:
    short = [(i, m, w) for i, (m, w) in enumerate(zip(made, wanted, strict=True)) if m < w]
    if short:
        i, m, w = short[0]
        print(f"WARNING: {backend} stopped {len(short)} request(s) early "
              f"(request {i}: {m} of {w} tokens); only generated tokens are counted.")


def make_backend(name: str, model: str, dtype: str, engine_kwargs: dict[str, Any],
                 hf_batch_size: int) -> Backend:
    if name == "pagoda":
        return PagodaBackend(model, dtype, engine_kwargs)
    if name == "hf":
        return HFBackend(model, dtype, hf_batch_size)
    raise ValueError(f"backend must be 'pagoda' or 'hf', got {name!r}.")


def timed(backend: Backend, prompts: list[list[int]], output_lens: list[int],
          use_tqdm: bool = False) -> tuple[float, int]:
    """Wall time (s) of one generate call, and the useful tokens it made."""
    start = time.perf_counter()
    useful = backend.generate(prompts, output_lens, use_tqdm)
    return time.perf_counter() - start, useful
