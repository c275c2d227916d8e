"""Beam search, as vLLM does it: in the frontend, one token a step for every live beam.

Each step every beam is a request of one token asking for the top `2 x beam_width` logprobs
(its prompt, the beam's tokens so far, is the last step's plus one token: the prefix cache
serves the rest). Every candidate extends its beam's cumulative logprob; one ending in EOS
completes (unless `ignore_eos`), the others compete, and the best `beam_width` by score go on.
After `max_tokens` steps, or when no beam is left, the completed beams and the live ones are
ranked together and the best `beam_width` returned. A beam's score is vLLM's: its cumulative
logprob over its length (prompt included, a final EOS not) to the power `length_penalty`.

The search itself (`BeamSearch`, `live_beams`, `advance_all`) is plain data and arithmetic;
`LLM.beam_search` and the server's `use_beam_search` run its steps on their engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagoda.outputs import Logprob
from pagoda.sampling_params import SamplingParamError, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`.

    Attributes:
        beam_width: beams kept each step, and sequences returned.
        max_tokens: most tokens a beam gains.
        ignore_eos: an EOS continues its beam instead of completing it.
        temperature: that of each step's request (the logprobs ranked are the raw logits').
        length_penalty: the exponent of the length a beam's logprob is divided by.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and self.beam_width >= 1):
            raise SamplingParamError("n", f"beam_width (n) must be at least 1, got {self.beam_width}.")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise SamplingParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not math.isfinite(self.length_penalty):
            raise SamplingParamError("length_penalty", f"length_penalty must be finite, got {self.length_penalty}.")

    def step_params(self) -> SamplingParams:
        """What each beam asks of the engine in a step."""
        # NOTE: as vLLM's, beams are never watermarked (their tokens are ranked, not sampled)
        return SamplingParams(temperature=self.temperature, max_tokens=1, ignore_eos=True,
                              logprobs=2 * self.beam_width, watermarking=False)


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), cumulative logprob, and when returned its
    generated text and why it ended ('stop': an EOS, 'length': max_tokens)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: cumulative logprob / length ** length_penalty."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The search of one prompt (see the module docstring)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: set[int]) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """One step: `candidates[i]` are the logprobs the engine gave beam i's next token."""
        grown = []
        for beam, logprobs in zip(self.beams, candidates, strict=True):
            for token_id, logprob in logprobs.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.cum_logprob + logprob.logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    self.completed.append(child)
                else:
                    grown.append(child)
        self.beams = self._best(grown)

    def result(self, tokenizer: object | None) -> BeamSearchOutput:
        """The best beams, completed and live alike, each with its generated text."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = self._best(self.completed + self.beams)
        decode = getattr(tokenizer, "decode", None)
        for beam in best:
            generated = beam.tokens[self.prompt_len:]
            if beam.finish_reason == "stop":
                generated = generated[:-1]
            beam.text = decode(generated) if decode is not None else None
        return BeamSearchOutput(best)

    def _best(self, beams: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        # NOTE: sorted() is stable: among equal scores the earlier candidate (the better-ranked
        # token of the better beam) stays ahead.
        return sorted(beams, key=lambda b: beam_score(b, self.eos_token_ids, self.params.length_penalty),
                      reverse=True)[: self.params.beam_width]


def live_beams(searches: list[BeamSearch]) -> list[tuple[BeamSearch, BeamSearchSequence]]:
    """Every search's live beams, in order: one request each this step."""
    return [(search, beam) for search in searches for beam in search.beams]


def advance_all(searches: list[BeamSearch], live: list[tuple[BeamSearch, BeamSearchSequence]],
                candidates: list[dict[int, Logprob]]) -> None:
    """Hands each search the logprobs its live beams (`live`, as run) got."""
    for search in searches:
        search.advance([c for (owner, _), c in zip(live, candidates, strict=True) if owner is search])
