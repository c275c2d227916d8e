"""Pooling: a request that ends with one vector of its prompt's hidden states, no tokens.

`PoolingParams` (vLLM's names) make a request a pooled one: it runs its prompt's prefill
like any other request (chunked, preemptible) and finishes, once the whole prompt is
computed, with the pooled final-norm hidden states (the rows the LM head would read):
- LAST (decoder LLMs' default, as vLLM): the last prompt row, pooled by the final chunk
  alone. Such a request takes prefix-cache hits: the last prompt token is never a hit.
- MEAN: every prompt row. Each chunk returns the float32 sum of the rows it computes, past
  `Request.num_pooled_tokens` (rows already summed), so a recompute after preemption sums
  none twice; the engine adds the sums up. Such a request takes no prefix-cache hits (the
  KV of a cached block is there, not its hidden states: as for prompt logprobs).
The vector is then cut to `dimensions` (Matryoshka) and L2-normalized when `normalize`.

Like prompt logprobs (prompt_logprobs.py), it comes out of the prefill's own rows: the runner
returns each pooled chunk's `PoolRows` (plain data, so parallel workers return them too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch

from pagoda.sampling_params import SamplingParamError

PoolingType = Literal["LAST", "MEAN"]
POOLING_TYPES = ("LAST", "MEAN")
POOLING_TASKS = ("embed", "encode")


@dataclass(frozen=True)
class PoolingParams:
    """How a pooled request pools (vLLM's `PoolingParams`).

    Args:
        dimensions: keep the first N dimensions (Matryoshka), then normalize; only for
            models that declare Matryoshka support (vLLM's rule; `InputProcessor` checks).
        normalize: L2-normalize the vector (vLLM's default for `embed`).
        pooling_type: LAST or MEAN. NOTE: vLLM sets it per model (`--pooler-config`); here
            it is per request too, LAST by default as vLLM's for decoder LLMs.
        task: vLLM's pooling task; "embed" and "encode" give the same vector here.
        truncate_prompt_tokens: keep only the prompt's last N tokens (-1: the context length).
    """

    dimensions: int | None = None
    normalize: bool = True
    pooling_type: PoolingType = "LAST"
    task: str = "embed"
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise SamplingParamError("pooling_type", f"pooling_type must be one of {POOLING_TYPES}, "
                                                     f"got {self.pooling_type!r}.")
        if self.task not in POOLING_TASKS:
            raise SamplingParamError("task", f"task must be one of {POOLING_TASKS}, got {self.task!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamError("dimensions", f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and (
                self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            raise SamplingParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or "
                                     f"positive, got {self.truncate_prompt_tokens}.")

    @property
    def pools_every_row(self) -> bool:
        return self.pooling_type == "MEAN"


@dataclass(frozen=True)
class PoolerConfig:
    """What the model says of its embeddings: their width, and its Matryoshka support (a
    config's `is_matryoshka`, or the `matryoshka_dimensions` it was trained for, as vLLM reads)."""

    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def from_hf_config(cls, hf_config: object) -> PoolerConfig:
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        return cls(int(getattr(hf_config, "hidden_size", 0)),
                   bool(getattr(hf_config, "is_matryoshka", False)) or dims is not None,
                   tuple(dims) if dims is not None else None)

    def check(self, params: PoolingParams) -> None:
        """vLLM's rules for `dimensions`: only on a Matryoshka model, within its sizes."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.is_matryoshka:
            raise SamplingParamError(
                "dimensions", "Model does not support matryoshka representation, changing output "
                              "dimensions will lead to poor results.")
        if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
            raise SamplingParamError(
                "dimensions", f"Model only supports {list(self.matryoshka_dimensions)} matryoshka "
                              f"dimensions, use other output dimensions will lead to poor results.")
        if dims > self.hidden_size:
            raise SamplingParamError(
                "dimensions", f"dimensions must be at most the model's {self.hidden_size}, got {dims}.")


@dataclass
class PoolRows:
    """Prompt rows a step pools for one request (plain data: it travels to workers):
    `index` is the request's place in the step's `SchedulerOutput`; `count` rows from
    position `start` on, their hidden rows following each other in `ModelInputs.pool_rows`."""

    index: int
    start: int
    count: int


class Poolable(Protocol):
    """What pooling reads of a request (a `Request` or a worker's copy)."""

    pooling_params: PoolingParams | None
    num_computed_tokens: int
    num_pooled_tokens: int

    @property
    def num_prompt_tokens(self) -> int: ...


Req = TypeVar("Req")


def positions_to_pool(request: Poolable, num_scheduled_tokens: int) -> tuple[int, int]:
    """The (first position, count) of the prompt rows this chunk pools (count may be 0)."""
    params = request.pooling_params
    if params is None:
        return 0, 0
    end = min(request.num_computed_tokens + num_scheduled_tokens, request.num_prompt_tokens)
    if not params.pools_every_row:
        last = request.num_prompt_tokens - 1
        return (last, 1) if request.num_computed_tokens <= last < end else (0, 0)
    start = max(request.num_computed_tokens, request.num_pooled_tokens)
    return start, max(end - start, 0)


def pool_chunks(hidden: torch.Tensor, requests: Sequence[Req],
                rows: list[PoolRows]) -> dict[Req, PooledPart]:
    """Each request's part of its pooled vector (float32) from `hidden`, the rows of `rows`
    in order: the last row (LAST), or the sum of the chunk's rows (MEAN)."""
    parts: dict[Req, PooledPart] = {}
    first = 0
    for span in rows:
        chunk = hidden[first:first + span.count].float()
        parts[requests[span.index]] = PooledPart(chunk.sum(dim=0).cpu(), span.start, span.count)
        first += span.count
    return parts


@dataclass
class PooledPart:
    """One step's part of a request's pooled vector: the sum of `count` rows from `start`."""

    total: torch.Tensor
    start: int
    count: int


def finish_vector(total: torch.Tensor, num_rows: int, params: PoolingParams) -> list[float]:
    """The pooled vector from the sum of its rows: mean, Matryoshka cut, L2 norm."""
    vector = total / max(num_rows, 1)
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector.tolist()
