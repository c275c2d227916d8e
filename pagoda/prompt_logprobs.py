"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

They come out of the prefill itself, without a second pass: the hidden row at position p
predicts the token at p + 1, so a request asking for `prompt_logprobs` has the rows of its
prompt positions 0 .. P - 2 projected to logits as well as its sampling row. Under chunked
prefill each chunk scores its own positions (the last row of a non-final chunk scores the
first token of the next chunk). `Request.num_prompt_logprobs` counts the positions already
reported, so a preempted request recomputed from the start reports none twice.

A request with prompt logprobs takes no prefix-cache hits (as vLLM v1's KV cache manager):
the KV of a cached block is there, but not the logits of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.request import Request
from pagoda.sampler import SamplerOutput, TokenLogprobs, top_logprobs

# NOTE: rows scored at once: bounds the float32 copy of a long prompt's logits.
SCORE_ROWS = 256


@dataclass
class PromptRows:
    """Prompt positions a step scores for one request (plain data: it travels to workers).

    `index` is the request's place in the step's `SchedulerOutput`; positions `start` to
    `start + count - 1` are scored, their logits rows following the sampling rows in order.
    """

    index: int
    start: int
    count: int


def positions_to_score(request: Request, num_scheduled_tokens: int) -> tuple[int, int]:
    """The (first position, count) of the prompt positions this chunk scores (count may be 0).

    NOTE: the last prompt position predicts the first output token: the sampler's row."""
    if request.sampling_params.prompt_logprobs is None:
        return 0, 0
    start = max(request.num_computed_tokens, request.num_prompt_logprobs)
    end = min(request.num_computed_tokens + num_scheduled_tokens, request.num_prompt_tokens - 1)
    return start, max(end - start, 0)


def score(logits: torch.Tensor, requests: list[Request],
          rows: list[PromptRows]) -> dict[Request, list[TokenLogprobs]]:
    """Each request's entries for the positions in `rows` (the prompt token at p + 1 with its
    rank, plus the top `prompt_logprobs`), from `logits` holding those rows in order."""
    scores: dict[Request, list[TokenLogprobs]] = {}
    first = 0
    for span in rows:
        request = requests[span.index]
        targets = request.prompt_token_ids[span.start + 1:span.start + 1 + span.count]
        num = request.sampling_params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for lo in range(0, span.count, SCORE_ROWS):
            chunk = logits[first + lo:first + min(lo + SCORE_ROWS, span.count)]
            entries += top_logprobs(chunk.float().log_softmax(dim=-1),
                                    targets[lo:lo + SCORE_ROWS], [num] * chunk.shape[0])
        scores[request] = entries
        first += span.count
    return scores


def with_prompt_logprobs(result: SamplerOutput | None, logits: torch.Tensor,
                         requests: list[Request], rows: list[PromptRows]) -> SamplerOutput | None:
    """`result` (None when nothing sampled) with the step's prompt logprobs added."""
    if not rows:
        return result
    result = result if result is not None else SamplerOutput([], [])
    result.prompt_logprobs = score(logits, requests, rows)
    return result
