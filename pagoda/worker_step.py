"""What crosses to a parallel worker each step, and what comes back.

The engine keeps every request's state (tokens, seeds, grammars, drafts); a worker runs the
same `ModelRunner` as one process does, on a `SchedulerOutput` whose requests are
`WorkerRequest`s: plain-data copies of what input preparation and sampling read of a
sequence in this step. Each worker prepares its own inputs from it; the last stage samples
and answers a `WorkerOutput` (token ids, logprobs, prompt logprobs, seeded generators'
states, pooled requests' parts of their vectors), never logits.

What a worker cannot hold is computed here, in the engine, before the step: a grammar's
bitmask rows (`MaskedGrammar`: the sampling row, or one row per draft position), and a
seeded generator's state, which the worker's sampler advances and sends back. Nothing but
LoRA adapters (loaded by a `LoRAControl` between steps) is kept in the workers between steps,
so a rerun of a failed step (isolation.py) sends the same copies again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from pagoda.lora import LoRARequest
from pagoda.pooling import PooledPart, PoolingParams
from pagoda.request import Request
from pagoda.sampler import SamplerOutput, TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import SchedulerOutput

Key = tuple[str, int]


class MaskedGrammar:
    """A grammar's bitmask rows for one step, computed in the engine: row 0 is the sampling
    row; with drafts, row j is the mask after the draft's first j tokens."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def fill_bitmask(self, row: torch.Tensor) -> None:
        row.copy_(self.rows[0])

    def fill_bitmasks_along(self, tokens: list[int], bitmask: torch.Tensor) -> None:
        bitmask.copy_(self.rows[:len(tokens) + 1])


@dataclass(eq=False)
class WorkerRequest:
    """One scheduled sequence as a worker sees it for one step (see the module docstring).

    `token_ids` are the sequence's tokens from position `first_token` on: the ones this step
    computes, or all of them when penalties need the history.
    """

    request_id: str
    sample_index: int
    sampling_params: SamplingParams
    num_computed_tokens: int
    num_tokens: int
    num_output_tokens: int
    num_prompt_tokens: int
    block_ids: list[int]
    token_ids: list[int]
    first_token: int
    eos_token_ids: set[int]
    num_prompt_logprobs: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)  # NOTE: only to score prompt logprobs
    generator_state: bytes | None = None
    grammar: MaskedGrammar | None = None
    pooling_params: PoolingParams | None = None
    num_pooled_tokens: int = 0
    lora_request: LoRARequest | None = None
    watermark_context: tuple[int, ...] | None = None  # NOTE: computed in the engine, as `Request.watermark_context`
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    @property
    def generator(self) -> torch.Generator | None:
        """The seeded generator, made from its state where the copy is used (a generator
        itself would travel as a second copy of the state)."""
        if self._generator is None and self.generator_state is not None:
            self._generator = set_state(torch.Generator(), self.generator_state)
        return self._generator

    @property
    def key(self) -> Key:
        return self.request_id, self.sample_index

    def token_ids_between(self, start: int, end: int) -> list[int]:
        assert start >= self.first_token, "this copy holds the step's tokens only"
        return self.token_ids[start - self.first_token:end - self.first_token]

    @property
    def all_token_ids(self) -> list[int]:
        assert self.first_token == 0, "this copy holds the step's tokens only"
        return self.token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]


def state_bytes(generator: torch.Generator) -> bytes:
    """A generator's state as bytes. NOTE: pickled, bytes cost ~14 us a round trip where the
    state's tensor costs ~1.1 ms (measured on a Zen 3, 5,056 bytes of mt19937 state)."""
    return generator.get_state().numpy().tobytes()


def set_state(generator: torch.Generator, state: bytes) -> torch.Generator:
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def worker_request(request: Request, num_tokens: int, draft: list[int],
                   vocab_size: int) -> WorkerRequest:
    """The copy of `request` a worker needs to run `num_tokens` of it (and its draft)."""
    params = request.sampling_params
    first = 0 if params.reads_history else request.num_computed_tokens
    samples = request.num_computed_tokens + num_tokens >= request.num_tokens
    grammar = None
    if samples and request.grammar is not None:
        rows = torch.full((len(draft) + 1, -(-vocab_size // 32)), -1, dtype=torch.int32)
        request.grammar.fill_bitmasks_along(draft, rows)
        grammar = MaskedGrammar(rows)
    return WorkerRequest(
        request.request_id, request.sample_index, params, request.num_computed_tokens,
        request.num_tokens, request.num_output_tokens, request.num_prompt_tokens,
        request.block_ids, request.all_token_ids[first:], first, request.eos_token_ids,
        request.num_prompt_logprobs,
        request.prompt_token_ids if params.prompt_logprobs is not None else [],
        state_bytes(request.generator) if samples and request.generator is not None else None,
        grammar, request.pooling_params, request.num_pooled_tokens, request.lora_request,
        request.watermark_context if samples else None)


def for_workers(out: SchedulerOutput, vocab_size: int) -> SchedulerOutput:
    """`out` with each request replaced by its `WorkerRequest` (drafts kept)."""
    copy = SchedulerOutput()
    for request, num_tokens in zip(out.requests, out.num_scheduled_tokens, strict=True):
        draft = out.drafts(request)
        # NOTE: a WorkerRequest has every attribute the runner reads of a Request.
        copy.add(cast(Request, worker_request(request, num_tokens, draft, vocab_size)), num_tokens,
                 draft)
    return copy


@dataclass(frozen=True)
class LoRAControl:
    """Between steps: load `request`'s adapter on every rank, or drop adapter `remove_id`.
    Each rank loads its shard and stage of it; they agree, so a refusal is every rank's."""

    request: LoRARequest | None = None
    remove_id: int | None = None


@dataclass(frozen=True)
class LoRAReply:
    """The ranks' agreed answer to a `LoRAControl`: why a rank refused the adapter, or None;
    whether a removed adapter was loaded."""

    error: str | None = None
    removed: bool = False


@dataclass
class WorkerOutput:
    """A step's result from the last stage, by sequence key (plain data)."""

    keys: list[Key]  # the sequences that sampled, in the sampler's order
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    spec_token_ids: list[list[int]] | None = None
    prompt_logprobs: dict[Key, list[TokenLogprobs]] = field(default_factory=dict)
    generator_states: dict[Key, bytes] = field(default_factory=dict)
    pooled: dict[Key, PooledPart] = field(default_factory=dict)

    @classmethod
    def of(cls, sampled: list[Request], result: SamplerOutput | None) -> WorkerOutput:
        """The reply for a step of `WorkerRequest`s (typed as the runner sees them)."""
        if result is None:
            return cls([], [], [])
        states = {r.key: state_bytes(r.generator) for r in sampled if r.generator is not None}
        return cls([r.key for r in sampled], result.token_ids, result.logprobs,
                   result.spec_token_ids,
                   {r.key: entries for r, entries in result.prompt_logprobs.items()}, states,
                   {r.key: part for r, part in result.pooled.items()})

    def for_engine(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """The engine's (sampled requests, SamplerOutput) for `out`; seeded requests'
        generators take the states their sampling left."""
        by_key = {r.key: r for r in out.requests}
        for key, state in self.generator_states.items():
            generator = by_key[key].generator
            assert generator is not None
            set_state(generator, state)
        if not self.keys and not self.prompt_logprobs and not self.pooled:
            return [], None
        result = SamplerOutput(self.token_ids, self.logprobs, self.spec_token_ids,
                               {by_key[k]: v for k, v in self.prompt_logprobs.items()},
                               {by_key[k]: v for k, v in self.pooled.items()})
        return [by_key[k] for k in self.keys], result


@dataclass
class WorkerStepError:
    """A step failed on the workers (preparing inputs, the model's forward on every rank of
    a stage, sampling): every rank left it alike, so the workers go on; the engine reruns the
    step request by request to find the culprit, as in one process."""

    kind: str
    message: str
