"""Speculative decoding: proposers draft tokens, the target verifies them in one step.

Modules: `ngram` (prompt lookup: drafts copied from the request's own context),
`draft_model` (a smaller model drafts greedily), `rejection` (accepts the longest prefix the
target agrees with, exactly preserving the target's distribution).
"""

from __future__ import annotations

from typing import Protocol

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.request import Request

# NOTE: a step's drafted tokens, by request (those without a draft are absent).
Drafts = dict[Request, list[int]]


class Proposer(Protocol):
    def propose(self, requests: list[Request]) -> Drafts:
        """This step's drafts for the running `requests`."""


def build_proposer(spec: SpeculativeConfig | None, config: EngineConfig,
                   vocab_size: int) -> Proposer | None:
    """The proposer `spec` asks for (None: no speculative decoding)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        from pagoda.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    from pagoda.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, config, vocab_size)
