"""Sampler math against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

from pagoda.request import Request
from pagoda.sampler import TOP_CANDIDATES, Sampler, argmax_rows, widening_candidate_sets
from pagoda.sampling_params import SamplingParams
from pagoda.worker_step import worker_request

VOCAB = 16


def _request(output: list[int], **params) -> Request:
    from pagoda.sampling_params import SamplingParams

    r = Request("r", [7], SamplingParams(max_tokens=50, **params), eos_token_ids={2})
    for t in output:
        r.append_token(t)
    return r


def _logits() -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[3], row[4], row[7] = 5.0, 4.9, 4.95
    return row[None, :]


def test_greedy_fast_path():
    out = Sampler()(_logits(), [_request([], temperature=0.0)])
    assert out.token_ids == [3] and out.logprobs == [None]


def test_bad_words_mask_the_token_that_would_complete_one():
    """vLLM's rule: a one-token bad word never comes; a longer one's last token only where the
    output so far ends with the tokens before it (the prompt does not count)."""
    words = ((3,), (4, 7))

    def sample(output: list[int]) -> int:
        r = _request(output, temperature=0.0, bad_words=["x"])
        r.sampling_params.bad_words_token_ids = words  # NOTE: as InputProcessor resolves them
        return Sampler()(_logits(), [r]).token_ids[0]

    assert sample([]) == 7  # 3 banned; 7 (4.95) beats 4 (4.9)
    assert sample([4]) == 4  # after 4, 7 would complete (4, 7): the next best, 4
    assert sample([4, 5]) == 7
    plain, banning = _request([4], temperature=0.0), _request([4], temperature=0.0, bad_words=["x"])
    banning.sampling_params.bad_words_token_ids = words
    for r in (plain, banning):
        r.num_computed_tokens = 1  # NOTE: decoding: the last token is the step's
    assert worker_request(plain, 1, [], VOCAB).first_token == 1  # only the step's tokens travel
    assert worker_request(banning, 1, [], VOCAB).output_token_ids == [4]  # the history bad words read


def test_frequency_and_presence_penalties():
    # token 3 seen twice: 5.0 - 2 * 0.1 = 4.8 < 4.95 (token 7, prompt only: not penalised)
    assert Sampler()(_logits(), [_request([3, 3], temperature=0.0, frequency_penalty=0.1)]).token_ids == [7]
    assert Sampler()(_logits(), [_request([3], temperature=0.0, presence_penalty=0.2)]).token_ids == [7]


def test_repetition_penalty_covers_prompt_and_output():
    # 3 -> 5/1.1 = 4.55, 7 (prompt) -> 4.5, 4 untouched at 4.9
    assert Sampler()(_logits(), [_request([3], temperature=0.0, repetition_penalty=1.1)]).token_ids == [4]


def test_min_tokens_masks_eos():
    logits = _logits()
    logits[0, 2] = 10.0
    assert Sampler()(logits, [_request([], temperature=0.0, min_tokens=2)]).token_ids == [3]
    assert Sampler()(logits, [_request([5, 6], temperature=0.0, min_tokens=2)]).token_ids == [2]


def test_min_tokens_masks_each_rows_own_stops_in_one_batch():
    logits = _logits().repeat(3, 1)
    logits[:, 2], logits[:, 9] = 10.0, 9.0
    batch = [_request([], temperature=0.0, min_tokens=2),  # EOS 2 masked -> 9
             _request([], temperature=0.0, min_tokens=2, stop_token_ids=[9]),  # 2 and 9 masked -> 3
             _request([5, 6], temperature=0.0, min_tokens=2)]  # past min_tokens -> 2
    assert Sampler()(logits, batch).token_ids == [9, 3, 2]


@pytest.mark.parametrize("vocab", [5, 1024, 3000, 49152, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(vocab: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen).to(dtype)
    x[1] = x[1].round()  # many ties: the first maximum wins
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")  # NaN counts as the maximum
    x[4, -1] = 100.0  # the maximum in the last (shorter) chunk
    x[5, :] = 1.0
    want = x.float().argmax(dim=-1)
    assert torch.equal(argmax_rows(x.float()), want)
    assert torch.equal(argmax_rows(x), want)  # the kernel's dtype as it is, else widened first
    with monkeypatch.context() as patch:  # NOTE: the torch path, as without the CPU kernels
        patch.setattr("pagoda.layers.cpu_kernels.takes", lambda t: False)
        assert torch.equal(argmax_rows(x), want)


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    for params in (dict(top_k=1), dict(top_p=0.01), dict(min_p=0.99)):
        tokens = {Sampler()(_logits(), [_request([], temperature=1.0, **params)]).token_ids[0] for _ in range(20)}
        assert tokens == {3}, params
    tokens = {Sampler()(_logits(), [_request([], temperature=1.0, top_k=3)]).token_ids[0] for _ in range(60)}
    assert tokens <= {3, 4, 7} and len(tokens) > 1


def test_top_k_top_p_among_candidates_equals_a_whole_sort():
    """The kept sets (and values) of the candidates' shortcut are a whole sort's, for peaked and
    flat rows, top k below, between and above the candidates (256, then 1,024), with and without
    top p."""
    gen = torch.Generator().manual_seed(5)
    vocab = 4000
    # NOTE: the flat rows' (scale 0.05) sets go past the candidates
    settings = [(k, p, scale) for k in (0, 3, 200, 1000, vocab) for p in (1.0, 0.95, 0.5)
                for scale in (8.0, 1.0, 0.05)]
    logits = torch.randn(len(settings), vocab, generator=gen) * torch.tensor([s for *_, s in settings])[:, None]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p, _ in settings]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    want = Sampler._sorted_top_k_top_p(logits, top_k, top_p)
    got = Sampler()._top_k_top_p(logits, params, vocab)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)
    kept = (~torch.isinf(got)).sum(dim=-1)
    assert kept.min() >= 1 and kept.max() > TOP_CANDIDATES
    narrowed = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    found, rest = widening_candidate_sets(logits[narrowed], torch.ones(len(narrowed)), [params[i] for i in narrowed])
    assert len(found) == 2 and all(len(rows) for rows, *_ in found) and rest  # NOTE: 256, 1,024, whole sorts
    # NOTE: neither top k nor top p: every token kept, even those whose probability rounds to 0
    assert all(torch.equal(got[i], logits[i]) for i, p in enumerate(params) if i not in narrowed)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_candidate_draws_pick_the_whole_rows_tokens(path: str, monkeypatch) -> None:
    """Rows whose top-k / top-p set ends among their candidates draw among those alone; given the
    same uniforms they pick the tokens that the whole row's softmax and running sums pick, over
    temperatures, top k below and above the candidates, top p, min p; rows whose set goes past
    the candidates (flat, a top k between them and the vocabulary) take the whole row, rows with
    min-p alone draw among the candidates where min-p ends their set there, and rows at a
    temperature alone take the kernels' draw (`draw_rows`) or torch's."""
    import pagoda.sampler as sampler_module
    from pagoda.layers import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "takes", lambda x: False)
    elif not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    gen = torch.Generator().manual_seed(11)
    vocab, draws = 5000, 12
    settings = [(t, k, p, m, scale) for t in (0.5, 1.3) for k, p in ((0, 0.9), (40, 1.0), (0, 0.5), (300, 0.95), (3, 0.99), (0, 1.0))
                for m in (0.0, 0.05) for scale in (6.0, 0.05)]
    rows = [s for s in settings for _ in range(draws)]
    logits = torch.cat([torch.randn(1, vocab, generator=gen) * s[-1] for s in settings]).repeat_interleave(draws, 0)
    requests = [_request([], temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m, _ in rows]
    uniforms = torch.rand(len(rows), generator=gen, dtype=torch.float64)
    monkeypatch.setattr(sampler_module, "draw_uniforms", lambda generators: uniforms.clone())
    got = Sampler()._draw(logits.clone(), requests)
    want = sampler_module.inverse_cdf(Sampler().distributions(logits, requests), uniforms)
    assert got == want
    _, _, complete = sampler_module.candidate_sets(logits, torch.tensor([r[0] for r in rows]),
                                                   [r.sampling_params for r in requests])
    assert 0 < int(complete.sum()) < len(rows)  # NOTE: both paths ran
    assert any(complete[i] for i, (_, k, p, m, _) in enumerate(rows) if k == 0 and p == 1.0 and m > 0)  # min-p alone


def test_penalties_of_a_batch_equal_each_rows_own():
    """The batched penalties (one scatter over the batch's token ids) give each row exactly what
    vLLM's rules give it alone: repetition over prompt and answer (repeated ids once), presence
    and frequency over the answer (counted), rows without penalties untouched."""
    gen = torch.Generator().manual_seed(3)
    vocab = 300
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.25),
                dict(repetition_penalty=0.8, frequency_penalty=-0.5), dict(), dict(presence_penalty=1.0),
                dict(repetition_penalty=1.1, presence_penalty=0.2)]
    requests = []
    for i, params in enumerate(settings):
        prompt = torch.randint(0, vocab, (20 + i,), generator=gen).tolist()
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=1.0, **params), eos_token_ids={2})
        for t in (torch.randint(0, vocab, (i * 3,), generator=gen).tolist() + prompt[:2] * 2) if i != 4 else []:
            r.append_token(t)
        requests.append(r)
    logits = torch.randn(len(settings), vocab, generator=gen) * 3
    want = logits.clone()
    for row, r in enumerate(requests):
        p = r.sampling_params
        if p.repetition_penalty != 1.0:
            for t in set(r.all_token_ids):
                v = want[row, t]
                want[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_token_ids):
            want[row, t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    got = logits.clone()
    Sampler()._apply_penalties(got, requests)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3]) and not torch.equal(got[0], logits[0])


def test_seeded_rows_ignore_batch_neighbours():
    a = Sampler()(_logits(), [_request([], temperature=1.0, seed=3)]).token_ids
    batch = torch.cat([_logits(), torch.randn(2, VOCAB)])
    reqs = [_request([], temperature=1.0, seed=3), _request([], temperature=1.0), _request([], temperature=0.5)]
    assert Sampler()(batch, reqs).token_ids[0] == a[0]


def test_logprobs_rank_and_topn():
    out = Sampler()(_logits(), [_request([], temperature=0.0, logprobs=2)])
    entry = out.logprobs[0]
    ref = _logits()[0].log_softmax(-1)
    assert set(entry) == {3, 7}
    assert entry[3] == (float(ref[3]), 1) and entry[7][1] == 2


def test_sampled_tokens_follow_the_distribution():
    """Temperature and top-k shape the distribution; the draws (one uniform a row, inverse
    CDF) match it within a chi-square bound and never pick a token top-k removed."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-0.5] * (VOCAB - 5)])
    requests = [_request([], temperature=0.7, top_k=4) for _ in range(4000)]
    torch.manual_seed(0)
    tokens = torch.tensor(Sampler()(logits.expand(len(requests), -1).clone(), requests).token_ids)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    probs = (logits[0, :4] / 0.7).softmax(-1).double()
    assert counts[4:].sum() == 0
    expected = probs * len(requests)
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, chi2)  # 3 degrees of freedom: P(chi2 > 16.3) < 0.001


def test_inverse_cdf_never_lands_on_a_token_of_probability_zero():
    from pagoda.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.4999999999, 0.5, 0.75, 1.0 - 2**-53):
        got = inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64))
        assert got == [1 if u < 0.5 else 3, 2]


@pytest.mark.parametrize("vocab", [700, 2048, 2500])
def test_the_two_level_running_sum_picks_the_flat_ones_token(vocab):
    """Blocks' sums, then sums inside one block: the token a flat float64 running sum picks,
    across block edges, a padded last block, zeros at block edges and mass in one block only."""
    from pagoda.sampler import inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(4, vocab, generator=g) * (torch.rand(4, vocab, generator=g) < 0.3)
    probs[1, :] = 0.0
    probs[1, vocab - 3] = 2.0  # NOTE: all the mass in the last (padded) block
    probs[2, 1020:1030] = 0.0
    probs[3, : vocab // 2] = 0.0
    for _ in range(50):
        u = torch.rand(4, generator=g, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        flat = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).tolist()
        got = inverse_cdf(probs, u)
        assert got == flat
        assert all(probs[r, t] > 0 for r, t in enumerate(got))


def test_a_row_without_a_distribution_still_gets_a_token_of_the_vocabulary():
    """repetition_penalty 5e-324 (valid: above 0) overflows logits to inf, the softmax to NaN."""
    from pagoda.sampler import inverse_cdf

    probs = torch.tensor([[float("nan")] * 6, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert inverse_cdf(probs, torch.tensor([0.3, 0.3], dtype=torch.float64)) == [0, 2]
    logits = torch.full((1, VOCAB), 1.0)
    tokens = Sampler()(logits, [_request([5, 6], temperature=1.0, repetition_penalty=5e-324)]).token_ids
    assert 0 <= tokens[0] < VOCAB


def test_a_seeded_row_draws_from_its_own_generator_only():
    logits = torch.zeros(3, VOCAB)
    seeded = lambda: _request([], temperature=1.0, seed=42)  # noqa: E731
    alone = [Sampler()(logits[:1].clone(), [seeded()]).token_ids[0] for _ in range(3)]
    mixed = [Sampler()(logits.clone(), [_request([], temperature=1.0), seeded(), _request([], temperature=1.0)]).token_ids[1]
             for _ in range(3)]
    assert alone == mixed and len(set(alone)) == 1


def test_logprobs_modes_report_vllms_four_views():
    """vLLM's --logprobs-mode: raw log-probabilities (default), raw logits, and the sampled
    distribution's (penalty, temperature, top-k applied; the rest -inf) normalized or not."""
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    greedy = dict(temperature=0.0, logprobs=3)
    sampled = dict(temperature=0.5, top_k=2, logprobs=3, seed=1, presence_penalty=1.0)

    def run(mode: str) -> list:
        requests = [_request([5], **greedy), _request([5], **sampled)]
        return Sampler(logprobs_mode=mode)(logits.clone(), requests).logprobs

    raw, raw_logits = run("raw_logprobs"), run("raw_logits")
    ref = logits.log_softmax(-1)
    for row in range(2):
        assert all(v == pytest.approx(float(ref[row, t]), abs=1e-5) for t, (v, _) in raw[row].items())
        assert all(v == pytest.approx(float(logits[row, t]), abs=1e-6) for t, (v, _) in raw_logits[row].items())
        assert {t: r for t, (_, r) in raw[row].items()} == {t: r for t, (_, r) in raw_logits[row].items()}
    processed, processed_logits = run("processed_logprobs"), run("processed_logits")
    assert processed[0] == raw[0]  # NOTE: a greedy row without penalties samples from its raw logits
    row = logits[1].clone()
    row[5] -= 1.0  # NOTE: the presence penalty on the output's token
    scaled = row / 0.5
    kept = scaled.topk(2).indices.tolist()
    expected = torch.full_like(scaled, float("-inf"))
    expected[kept] = scaled[kept]
    want = expected.log_softmax(-1)
    finite = {t: v for t, (v, _) in processed[1].items() if v > float("-inf")}
    assert set(finite) == set(kept)
    assert all(v == pytest.approx(float(want[t]), abs=1e-5) for t, v in finite.items())
    assert all(v == pytest.approx(float(expected[t]), abs=1e-5)
               for t, (v, _) in processed_logits[1].items() if v > float("-inf"))
