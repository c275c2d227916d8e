"""Speculative decoding's pieces without a model: prompt lookup and rejection sampling.

The statistical test draws many verifications of a fixed draft against a fixed target
distribution and checks that the first emitted token follows the target exactly (a
chi-square bound), as speculative sampling guarantees.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.request import Request
from pagoda.sampler import Sampler
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.ngram import propose_ngram
from pagoda.spec_decode.rejection import verify


def test_prompt_lookup_takes_the_most_recent_longest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [9, 1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [5, 6, 1]  # "1 2 3" last seen at 6..8
    assert propose_ngram(tokens, 10, 1, 3) == [5, 6, 1, 2, 3]  # to the end, never past it
    assert propose_ngram([4, 5, 6], 3, 1, 3) == []
    assert propose_ngram([4, 5, 4], 2, 1, 3) == [5, 4]  # n=1 only
    assert propose_ngram([4, 5, 4], 2, 2, 3) == []  # min_n 2: no match
    assert propose_ngram([7], 2, 1, 3) == []


def request(temperature: float, seed: int | None = None, **kw) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(temperature=temperature, seed=seed,
                                                  max_tokens=10, **kw))


def test_greedy_verification_accepts_the_agreeing_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([4, 6, 2, 9]):
        logits[row, token] = 5.0
    r, s = request(0.0), Sampler()
    assert verify(logits, [4, 6, 2], r, s) == [4, 6, 2, 9]  # all accepted + bonus
    assert verify(logits, [4, 7, 2], r, s) == [4, 6]  # corrected at the first disagreement
    assert verify(logits, [1, 6, 2], r, s) == [4]
    assert verify(logits[:1], [], r, s) == [4]


@pytest.mark.parametrize("draft_token", [0, 2, 4])
def test_sampled_verification_preserves_the_target_distribution(draft_token: int):
    target = torch.tensor([0.05, 0.1, 0.5, 0.05, 0.3])
    logits = target.log().repeat(2, 1)  # a one-token draft: two rows
    r, s = request(1.0, seed=123), Sampler()
    trials = 20_000
    counts = torch.zeros(5)
    for _ in range(trials):
        counts[verify(logits, [draft_token], r, s)[0]] += 1
    expected = target * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, chi2)  # 4 degrees of freedom: P(chi2 > 20.5) < 0.0004


def test_sampled_verification_respects_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)
    r = request(1.0, seed=7, top_k=2)
    seen = {verify(logits, [3], r, Sampler())[0] for _ in range(300)}
    assert seen == {0, 1}  # the draft (3) is outside top-k: always rejected, never emitted
