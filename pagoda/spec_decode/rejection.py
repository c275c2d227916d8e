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
from pagoda.sampler import Sampler


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
        target = logits.argmax(dim=-1).tolist()
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
    """One token from (unnormalized) probabilities, by an exponential race."""
    q = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / q).argmax())
