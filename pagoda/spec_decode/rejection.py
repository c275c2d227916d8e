"""Verifying a draft: accept the longest prefix the target agrees with, exactly.

Rows: a request with draft d_1..d_k has k + 1 logits rows; row j is the target's distribution
for the token after d_j (row 0: after the last accepted token). Drafts are deterministic
(prompt lookup, or a draft model's greedy choice), so the proposal q is one-hot on d_j.
- Greedy: t_j = argmax(row j); accept d_{j+1} while it equals t_j; the output is the accepted
  drafts plus the target's own token at the first disagreement (or after the last draft).
- Sampling: accept d_{j+1} with probability p_j(d_{j+1}) (= min(1, p/q) for one-hot q); on a
  rejection draw from p_j with d_{j+1} removed (the residual max(p - q, 0), normalized); if
  all are accepted draw a bonus token from p_k. The output tokens are then distributed
  exactly as the target's own samples (speculative sampling's guarantee).
Temperature, top-k, top-p and min-p shape p as in `Sampler`; a seeded request draws every
uniform and every sample from its own generator.
"""

from __future__ import annotations

import torch

from pagoda.request import Request
from pagoda.sampler import Sampler, SamplerOutput, argmax_rows, draw_uniforms, inverse_cdf
from pagoda.structured_output import apply_bitmask


def verify(logits: torch.Tensor, draft: list[int], request: Request,
           sampler: Sampler) -> list[int]:
    """The tokens a request emits this step: 1 to len(draft) + 1 of them.

    Args:
        logits: float32 [len(draft) + 1, vocab], the target's rows for this request.
        draft: the proposed tokens.
        request: its sampling params and generator.
        sampler: shapes the distributions (temperature, top-k/p, min-p).
    """
    params = request.sampling_params
    if params.greedy:
        target = argmax_rows(logits).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return draft[:accepted] + [target[accepted]]
    probs = sampler.distributions(logits, [request] * logits.shape[0])
    gen = request.generator
    for j, token in enumerate(draft):
        u = torch.rand((), generator=gen) if gen is not None else torch.rand(())
        if float(u) < float(probs[j, token]):
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        return draft[:j] + [_draw(residual, gen)]
    return draft + [_draw(probs[len(draft)], gen)]


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from (unnormalized) probabilities, as the sampler draws one."""
    return inverse_cdf(probs[None, :], draw_uniforms([gen]))[0]


def sample_with_drafts(sampler: Sampler, logits: torch.Tensor, requests: list[Request],
                       drafts: list[list[int]]) -> SamplerOutput:
    """A step's tokens: plain rows through the sampler, drafting requests verify their rows.

    `logits` holds one row per plain request and 1 + len(drafts[i]) per drafting one, in order.
    """
    if not any(drafts):
        return sampler(logits, requests)
    plain = [i for i, d in enumerate(drafts) if not d]
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += 1 + len(d)
    result = sampler(logits[[starts[i] for i in plain]], [requests[i] for i in plain])
    tokens: list[list[int]] = [[] for _ in requests]
    for i, token in zip(plain, result.token_ids, strict=True):
        tokens[i] = [token]
    for i, (r, d) in enumerate(zip(requests, drafts, strict=True)):
        if d:
            rows = logits[starts[i]:starts[i] + 1 + len(d)].float()
            if r.grammar is not None:
                bitmask = torch.full((rows.shape[0], -(-rows.shape[1] // 32)), -1,
                                     dtype=torch.int32)
                r.grammar.fill_bitmasks_along(d, bitmask)
                apply_bitmask(rows, bitmask)
            tokens[i] = verify(rows, d, r, sampler)
    logprobs: list = [None] * len(requests)
    for i, entry in zip(plain, result.logprobs, strict=True):
        logprobs[i] = entry
    return SamplerOutput([t[0] for t in tokens], logprobs, tokens)
