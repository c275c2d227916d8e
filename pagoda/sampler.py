"""Sampling: logits of the rows that sample -> token ids (and log-probabilities).

Token constraints come first: grammar bitmasks (structured outputs), allowed_token_ids,
logit_bias and bad words (vLLM's: a bad word's last token wherever the output so far ends with
the tokens before it). Greedy requests without penalties then take an argmax fast path. Otherwise, in
vLLM's order: penalties, min-tokens suppression, temperature, top-k / top-p / min-p, then an
draw per row from one uniform by the inverse of its cumulative distribution, or, for a request
carrying the engine's watermark, a Gumbel-max whose noise is the watermark's keyed function of
its context (watermark.py). A request with a seed draws only from its own generator, so its
tokens do not depend on what else is in the batch. Log-probabilities are of the raw logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.layers import cpu_kernels
from pagoda.pooling import PooledPart
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import apply_bitmask
from pagoda.watermark import Watermarker

# NOTE: the largest logits a row's top-k / top-p set is looked for among before a whole sort.
TOP_CANDIDATES = 256
CDF_BLOCK = 1024  # tokens a block of the sampler's two-level running sum

# token id -> (logprob, rank), for the sampled token and the top-N
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class SamplerOutput:
    """Per sampling request: its token, logprobs, and (speculative decoding) every token it
    emits this step, the first being `token_ids[i]`; plus the prompt logprobs scored."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    spec_token_ids: list[list[int]] | None = None
    # request -> entries of the prompt positions it scored this step (prompt_logprobs.py)
    prompt_logprobs: dict[Request, list[TokenLogprobs]] = field(default_factory=dict)
    # request -> its part of the pooled vector this step computed (pooling.py)
    pooled: dict[Request, PooledPart] = field(default_factory=dict)

    def emitted(self, index: int) -> list[int]:
        if self.spec_token_ids is not None:
            return self.spec_token_ids[index]
        return [self.token_ids[index]]


def _needs_full_path(requests: list[Request]) -> bool:
    for r in requests:
        p = r.sampling_params
        if not p.greedy or p.needs_penalties or r.num_output_tokens < p.min_tokens:
            return True
    return False


def argmax_rows(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D x, the same indices (the first maximum; NaN counts as one).

    NOTE: torch's CPU argmax is not vectorized: 2.6 ms for 64 rows of SmolLM2's 49,152 logits
    on one thread, against 0.34 ms here: every chunk's maximum (amax is vectorized), the first
    chunk holding the row's maximum, then argmax within that chunk alone. With the CPU kernels
    the rows go to their argmax kernel as they are (bf16 logits not widened to fp32 first:
    docs/performance.md, "Greedy sampling without the fp32 copy").
    """
    if cpu_kernels.takes(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(-1) == 1:
        return cpu_kernels.ops.argmax_rows(x)
    if x.dtype != torch.float32:
        x = x.float()
    rows, vocab = x.shape
    n = vocab // chunk
    if n < 2:
        return x.argmax(dim=-1)
    maxima = x[:, :n * chunk].reshape(rows, n, chunk).amax(dim=-1)
    if vocab > n * chunk:
        maxima = torch.cat([maxima, x[:, n * chunk:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1, keepdim=True) * chunk
    # NOTE: in the last, shorter chunk the clamped indices repeat the final logit after its
    # own position, so the first maximum is still found first.
    idx = (start + torch.arange(chunk, device=x.device)).clamp_(max=vocab - 1)
    return start.squeeze(1) + x.gather(1, idx).argmax(dim=-1)


def draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: a seeded request's from its own generator (so its
    tokens do not depend on the batch), the others' in one draw."""
    uniforms = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i] = torch.rand((), generator=g, dtype=torch.float64)
    return uniforms


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """A token per row of (unnormalized, non-negative) probabilities: the one whose interval
    of the running sum holds uniform x total, a sample of the row's distribution from one
    uniform; never a token of probability 0.

    NOTE: the exponential race (argmax p / q, q ~ Exp(1) per token, vLLM's CPU sampler and
    pagoda's before) draws a random number per token with torch's CPU `exponential_`: 14.55 ms
    for 16 rows of SmolLM2's 49,152 on one thread, as long as the model's own 16-row decode step
    (0.27 ms here; docs/benchmarks/sampling/draw_time.py). Here the running sum is taken in two levels: the sums of blocks of
    `CDF_BLOCK` tokens, then the sums inside the one block the uniform falls in (float64, so
    that no token's interval is lost to rounding)."""
    rows, vocab = probs.shape
    blocks = -(-vocab // CDF_BLOCK)
    p = probs.float()
    if blocks * CDF_BLOCK != vocab:
        p = torch.nn.functional.pad(p, (0, blocks * CDF_BLOCK - vocab))
    p = p.view(rows, blocks, CDF_BLOCK)
    ends = p.sum(dim=-1).double().cumsum(dim=-1)
    total = ends[:, -1:].contiguous()
    target = uniforms.to(ends)[:, None] * total
    # NOTE: u x total may round up to the total: the last block of nonzero mass then
    block = torch.searchsorted(ends, target, right=True).minimum(torch.searchsorted(ends, total))
    block = block.clamp_(max=blocks - 1)
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = p.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1).double().cumsum(dim=-1)
    offset = torch.searchsorted(inside, target - start, right=True)
    # NOTE: the block's own sums may round below its sum in `ends`: its last token of nonzero mass
    offset = offset.minimum(torch.searchsorted(inside, inside[:, -1:].contiguous()))
    index = (block * CDF_BLOCK + offset).squeeze(1)
    broken = ~(total.squeeze(1) > 0) | ~torch.isfinite(total.squeeze(1))
    if broken.any():
        # NOTE: a row of NaNs (logits overflowed by an extreme but valid penalty) has no sums to
        # search: its argmax, a NaN's position, as torch's argmax (and the race before) gives
        index[broken] = probs[broken].argmax(dim=-1)
    return index.tolist()


def _top_k_and_p(params: list[SamplingParams], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])[:, None]
    return top_k, torch.tensor([p.top_p for p in params])[:, None]


def top_candidates(logits: torch.Tensor, temps: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of `logits` divided by its temperature: its `width` largest values (descending),
    their token ids, and the log-sum-exp of the whole divided row; on the CPU kernels in one
    pass over the row (`cpu_kernels.ops.top_candidates`), elsewhere by torch's topk."""
    if cpu_kernels.takes(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return cpu_kernels.ops.top_candidates(logits, temps, width)
    scaled = logits / temps.to(logits)[:, None]
    values, index = scaled.topk(width, dim=-1)
    return values, index, scaled.logsumexp(dim=-1)


def candidate_sets(logits: torch.Tensor, temps: torch.Tensor, params: list[SamplingParams],
                   width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top-k, then top-p set among its `width` (default `TOP_CANDIDATES`) largest
    logits (divided by `temps`): (values, -inf outside the set; their token ids; whether the set
    is complete there).

    NOTE: sorting the whole vocabulary is the cost (16 rows of SmolLM2's 49,152: ~150 ms on one
    Zen 3 core, against 5 ms for their top 256 by torch's topk, less on the kernels). The
    candidates' probabilities are normalized over the whole row (or over its top k): where the
    set ends inside them, it is the set a full sort gives (up to rounding at the boundary and the
    order of tied logits), or where min-p ends it there; not where the distribution is flat, or a
    top k lies between the candidates and the vocabulary, or the row holds no finite logit or a NaN."""
    vocab = logits.shape[-1]
    width = min(width or TOP_CANDIDATES, vocab)
    top_k, top_p = _top_k_and_p(params, vocab)
    values, index, lse = top_candidates(logits, temps, width)
    drop = torch.arange(width)[None, :] >= top_k
    masked = values.masked_fill(drop, float("-inf"))
    norm = torch.where(top_k < vocab, masked.logsumexp(dim=-1, keepdim=True), lse[:, None])
    probs = (masked - norm).exp()
    drop |= ((probs.cumsum(dim=-1) - probs) > top_p) & (top_p < 1.0)  # NOTE: 1.0 keeps all (rounding)
    drop[:, 0] = False
    beyond = (top_k > width) & ((top_k < vocab) | ~drop[:, -1:])
    # NOTE: min-p (a token's probability at least min_p x the largest; `Sampler._draw` applies it)
    # ends the set among the candidates where the last of them falls below it by a margin, unless
    # top-p's sums needed a top k past the candidates
    min_p = torch.tensor([p.min_p for p in params], dtype=values.dtype)[:, None]
    by_min_p = ((values[:, -1:] - values[:, :1] < min_p.log() - 1e-3) & (min_p > 0)
                & ((top_k >= vocab) | (top_p >= 1.0)))
    complete = ~(beyond & ~by_min_p)[:, 0] & torch.isfinite(lse)
    return values.masked_fill(drop, float("-inf")), index, complete


def widening_candidate_sets(logits: torch.Tensor, temps: torch.Tensor, params: list[SamplingParams]
                            ) -> tuple[list[tuple[list[int], torch.Tensor, torch.Tensor]], list[int]]:
    """`candidate_sets` among the `TOP_CANDIDATES` largest logits, then, for the rows whose set
    goes past them, among 4x as many: ([(rows, kept values, token ids)] of the complete sets, the
    rows complete at neither width, which sort their whole row).

    NOTE: a flat distribution's top-p set holds hundreds of tokens (SmolLM2 at temperature 0.8,
    top-p 0.9, on the side-by-side's word-list prompts: ~10% of rows past 256, at most 798), and a
    whole sort of 49,152 logits costs ~3 ms a row, 15x the kernels' 1,024 largest."""
    vocab = logits.shape[-1]
    pending, found = list(range(len(params))), []
    for width in (TOP_CANDIDATES, 4 * TOP_CANDIDATES):
        if width >= vocab or not pending:
            break
        x = logits if len(pending) == logits.shape[0] else logits[pending]
        kept, index, complete = candidate_sets(x, temps[pending], [params[i] for i in pending], width)
        done = complete.nonzero().flatten()
        if len(done):
            found.append(([pending[j] for j in done.tolist()], kept[done], index[done]))
        pending = [i for i, c in zip(pending, complete.tolist(), strict=True) if not c]
    return found, pending


def _token_pairs(rows: list[int], token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) for every id of each row's list, as two int64 tensors."""
    total = sum(len(ids) for ids in token_ids)
    # NOTE: numpy reads Python ints ~8x faster than torch.tensor does
    ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total))
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.long)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths), ids


def apply_token_constraints(logits: torch.Tensor, requests: list[Request]) -> None:
    """Grammar bitmasks, allowed_token_ids, logit_bias, bad words and a spent thinking budget
    (`thinking_budget.py`), in place, on the rows that ask."""
    grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if grammar_rows:
        words = -(-logits.shape[-1] // 32)
        bitmask = torch.full((len(grammar_rows), words), -1, dtype=torch.int32)
        for j, i in enumerate(grammar_rows):
            requests[i].grammar.fill_bitmask(bitmask[j])  # type: ignore[union-attr]
        rows = logits[grammar_rows]
        apply_bitmask(rows, bitmask)
        logits[grammar_rows] = rows
    for row, r in enumerate(requests):
        p = r.sampling_params
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            kept = logits[row, keep]
            logits[row] = float("-inf")
            logits[row, keep] = kept
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.bad_words_token_ids:
            banned = completing_bad_words(p.bad_words_token_ids, r.output_token_ids)
            if banned:
                logits[row, banned] = float("-inf")
        if p.thinking_budget is not None:
            forced = p.thinking_budget.forced_token(r.all_token_ids, r.num_prompt_tokens)
            if forced is not None:  # NOTE: the thinking budget is spent: its end, token by token
                logits[row] = float("-inf")
                logits[row, forced] = 0.0


def completing_bad_words(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """vLLM's rule: each bad word's last token where the output so far ends with the tokens
    before it (a one-token word: always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= len(output) and (prefix == 0 or tuple(output[-prefix:]) == word[:-1]):
            banned.append(word[-1])
    return banned


class Sampler:
    """Args:
        watermarker: the engine's watermark (watermark.py), applied to the rows whose request
            carries it (`watermark_context`), or None.
        logprobs_mode: vLLM's: `logprobs` of the raw logits ("raw_logprobs", the default), the
            raw logits themselves ("raw_logits"), or of the distribution sampled from
            ("processed_logprobs": constraints, penalties, then for a sampled row its temperature
            and top-k/top-p/min-p, the tokens left out at -inf; "processed_logits" unnormalized).
    """

    def __init__(self, watermarker: Watermarker | None = None, logprobs_mode: str = "raw_logprobs") -> None:
        self.watermarker = watermarker
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """`logits` (any float dtype) stay as they are: raw log-probabilities are of these."""
        constrained = any(r.sampling_params.constrains_tokens for r in requests)
        full = _needs_full_path(requests)
        if not constrained and not full:
            tokens = argmax_rows(logits).tolist()
            return SamplerOutput(tokens, self._logprobs(logits, requests, tokens))
        work = logits.float()
        if work is logits:
            work = logits.clone()
        if constrained:
            apply_token_constraints(work, requests)
        processed = work
        if not full:
            tokens = argmax_rows(work).tolist()
        else:
            self._apply_penalties(work, requests)
            self._suppress_stops(work, requests)
            processed = self._processed(work, requests)
            tokens = self._sample(work, requests)
        return SamplerOutput(tokens, self._logprobs(logits if self.logprobs_mode.startswith("raw") else processed,
                                                    requests, tokens))

    def _logprobs(self, scores: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[TokenLogprobs | None]:
        return compute_logprobs(scores, requests, tokens, normalize=self.logprobs_mode.endswith("logprobs"))

    def _processed(self, work: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each row samples from, where processed logprobs are asked for:
        `work` (constraints and penalties in), a sampled row at its temperature with its
        top-k/top-p/min-p applied by a whole sort (the tokens left out at -inf); `work` itself
        otherwise."""
        rows = [i for i, r in enumerate(requests)
                if r.sampling_params.logprobs is not None and not r.sampling_params.greedy]
        if not self.logprobs_mode.startswith("processed") or not rows:
            return work
        temps = torch.tensor([requests[i].sampling_params.temperature for i in rows], dtype=work.dtype)
        processed = work.clone()
        processed[rows] = self._filter(work[rows] / temps[:, None], [requests[i] for i in rows], candidates=False)
        return processed

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """vLLM's penalties, every row at once: repetition over the prompt's and the answer's
        tokens (a logit above 0 divided by it, below multiplied), presence and frequency over
        the answer's. NOTE: only the (row, token) pairs the sequences hold are read and written,
        in one gather and one scatter for the batch: a loop over rows with sets and a tensor a
        row took ~5 ms a step for 16 rows of 1,500-token sequences, and the dense [rows, vocab]
        masks more."""
        params = [r.sampling_params for r in requests]
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            rows, ids = _token_pairs(rep, [requests[i].all_token_ids for i in rep])
            penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[rows]
            x = logits[rows, ids]
            logits[rows, ids] = torch.where(x > 0, x / penalty, x * penalty)
        fp = [i for i, p in enumerate(params)
              if (p.presence_penalty or p.frequency_penalty) and requests[i].output_token_ids]
        if fp:
            rows, ids = _token_pairs(fp, [requests[i].output_token_ids for i in fp])
            vocab = logits.shape[-1]
            pairs, counts = torch.unique(rows * vocab + ids, return_counts=True)
            rows, ids = pairs // vocab, pairs % vocab
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[rows]
            presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[rows]
            logits[rows, ids] -= frequency * counts.to(logits.dtype) + presence

    def _suppress_stops(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows: list[int] = []
        ids: list[int] = []
        for row, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens >= p.min_tokens:
                continue
            # NOTE: as vLLM: EOS is masked until min_tokens even with ignore_eos, so that
            # forced-length benchmarks generate the same tokens on every engine.
            stops = sorted(set(p.stop_token_ids) | r.eos_token_ids)
            if p.constrains_tokens:
                self._suppress_constrained(logits[row], stops)
            else:
                rows += [row] * len(stops)
                ids += stops
        if rows:
            logits[rows, ids] = float("-inf")

    @staticmethod
    def _suppress_constrained(row: torch.Tensor, stops: list[int]) -> None:
        """Masks `stops` unless nothing else is left (a grammar that allows only EOS wins over
        min_tokens)."""
        if not stops:
            return
        kept = row[stops].clone()
        row[stops] = float("-inf")
        if not torch.isfinite(row).any():
            row[stops] = kept

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        tokens = argmax_rows(logits).tolist()
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not rows:
            return tokens
        sampled = [requests[i] for i in rows]
        x = logits if len(rows) == len(requests) else logits[rows]
        marked = self._watermarked(x, sampled)
        for j, token in marked.items():
            tokens[rows[j]] = token
        drawn = [j for j in range(len(sampled)) if j not in marked]
        if drawn:
            picked = self._draw(x if len(drawn) == len(sampled) else x[drawn], [sampled[j] for j in drawn])
            for j, t in zip(drawn, picked, strict=True):
                tokens[rows[j]] = t
        return tokens

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """A token per row from its distribution (temperature, top-k / top-p / min-p), one uniform a
        row. A row whose top-k / top-p set ends among its largest logits draws among those
        alone (`widening_candidate_sets`): the softmax and the running sums over the whole
        vocabulary, most of a sampled step's cost, are skipped. A row at a temperature alone
        draws on the CPU kernels in one call (`cpu_kernels.ops.draw_rows`); the others take the
        whole row in torch."""
        uniforms = draw_uniforms([r.generator for r in requests])
        params = [r.sampling_params for r in requests]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        tokens: list[int | None] = [None] * len(requests)
        narrowed = [i for i, p in enumerate(params) if p.narrows]
        if narrowed:
            picked = narrowed if len(narrowed) < len(requests) else slice(None)
            found, _ = widening_candidate_sets(logits[picked], temps[picked], [params[i] for i in narrowed])
            for done, kept, index in found:
                rows = [narrowed[j] for j in done]
                min_p = torch.tensor([params[i].min_p for i in rows])[:, None]
                if (min_p > 0).any():
                    probs = kept.softmax(dim=-1)
                    kept = kept.masked_fill(probs < min_p * probs[:, :1], float("-inf"))
                order = index.argsort(dim=-1)  # NOTE: token order, as the whole row's running sums
                at = inverse_cdf(kept.gather(1, order).softmax(dim=-1), uniforms[rows])
                ids = index.gather(1, order)
                for k, (row, a) in enumerate(zip(rows, at, strict=True)):
                    tokens[row] = int(ids[k, a])
        plain = [i for i, t in enumerate(tokens) if t is None and not params[i].narrows]
        if plain and cpu_kernels.takes(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            x = logits if len(plain) == len(requests) else logits[plain]
            for i, t in zip(plain, cpu_kernels.ops.draw_rows(x, temps[plain], uniforms[plain]), strict=True):
                tokens[i] = t
        rest = [i for i, t in enumerate(tokens) if t is None]
        if rest:
            x = logits if len(rest) == len(requests) else logits[rest]
            # NOTE: these rows' candidates, where they narrow, were looked for above and fell short
            probs = self._filter(x / temps[rest][:, None], [requests[i] for i in rest], candidates=False).softmax(dim=-1)
            for i, t in zip(rest, inverse_cdf(probs, uniforms[rest]), strict=True):
                tokens[i] = t
        return [int(t) for t in tokens if t is not None]

    def _watermarked(self, logits: torch.Tensor, requests: list[Request]) -> dict[int, int]:
        """row -> token, for the rows sampled with the watermark (each with its context)."""
        if self.watermarker is None:
            return {}
        contexts = {j: c for j, r in enumerate(requests) if (c := r.watermark_context) is not None}
        if not contexts:
            return {}
        rows = list(contexts)
        processed = self.processed(logits if len(rows) == len(requests) else logits[rows], [requests[j] for j in rows])
        tokens = self.watermarker.sample(processed, [contexts[j] for j in rows],
                                         [requests[j].generator for j in rows])
        return dict(zip(rows, tokens, strict=True))

    def distributions(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then top-k / top-p / min-p."""
        return self.processed(logits, requests).softmax(dim=-1)

    def processed(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's logits divided by its temperature, -inf outside its top-k / top-p / min-p."""
        temps = torch.tensor([r.sampling_params.temperature for r in requests])
        return self._filter(logits / temps[:, None], requests)

    def _filter(self, logits: torch.Tensor, requests: list[Request], candidates: bool = True) -> torch.Tensor:
        """`candidates` False: top-k / top-p by a whole sort (rows whose candidates fell short)."""
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[-1]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = (self._top_k_top_p(logits, params, vocab) if candidates
                      else self._sorted_top_k_top_p(logits, *_top_k_and_p(params, vocab)))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params])[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits

    def _top_k_top_p(self, logits: torch.Tensor, params: list, vocab: int) -> torch.Tensor:
        """`logits` with -inf outside each row's top-k, then top-p set (at least one token): the
        set among the row's candidates (`candidate_sets`) where it ends there, else a whole sort."""
        top_k, top_p = _top_k_and_p(params, vocab)
        narrowed = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        x = logits if len(narrowed) == len(params) else logits[narrowed]
        found, rest = widening_candidate_sets(x, torch.ones(len(narrowed)), [params[i] for i in narrowed])
        out = logits.clone()
        out[narrowed] = float("-inf")
        for rows, kept, index in found:
            at = [narrowed[j] for j in rows]
            out[at] = out[at].scatter_(1, index, kept)
        if rest:
            at = [narrowed[j] for j in rest]
            out[at] = self._sorted_top_k_top_p(logits[at], top_k[at], top_p[at])
        return out

    @staticmethod
    def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(logits.shape[-1])[None, :] >= top_k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= ((probs.cumsum(dim=-1) - probs) > top_p) & (top_p < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def compute_logprobs(logits: torch.Tensor, requests: list[Request], token_ids: list[int],
                     normalize: bool = True) -> list[TokenLogprobs | None]:
    """The sampled token's log-probability and rank plus the top-N, per row (of `logits`; their
    values themselves where not `normalize`: vLLM's logits modes); for a request naming
    `logprob_token_ids`, those tokens' instead of the top-N (vLLM's)."""
    wanted = [r.sampling_params.logprobs for r in requests]
    rows = [i for i, n in enumerate(wanted) if n is not None]
    result: list[TokenLogprobs | None] = [None] * len(requests)
    if not rows:
        return result
    chosen = [requests[i].sampling_params.logprob_token_ids for i in rows]
    logprobs = logits[rows].float()
    logprobs = logprobs.log_softmax(dim=-1) if normalize else logprobs
    entries = top_logprobs(logprobs, [token_ids[i] for i in rows],
                           [0 if ids else wanted[i] or 0 for i, ids in zip(rows, chosen, strict=True)])
    for row, (i, entry, ids) in enumerate(zip(rows, entries, chosen, strict=True)):
        result[i] = entry if not ids else {**chosen_logprobs(logprobs[row], ids), **entry}
    return result


def chosen_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> TokenLogprobs:
    """One row's log-probabilities of `token_ids`, each with its rank (1 + the tokens strictly
    more likely)."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    values = logprobs[ids]
    ranks = ((logprobs[None, :] > values[:, None]).sum(dim=-1) + 1).tolist()
    return {t: (v, r) for t, v, r in zip(token_ids, values.tolist(), ranks, strict=True)}


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], nums: list[int]) -> list[TokenLogprobs]:
    """Per row of `logprobs` (float32 log-probabilities): the top `nums[row]` with ranks 1..N,
    and `token_ids[row]` with its own rank (1 + the tokens strictly more likely)."""
    top_vals, top_ids = logprobs.topk(max(max(nums), 1), dim=-1)
    tokens = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    token_lps = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = ((logprobs > token_lps[:, None]).sum(dim=-1) + 1).tolist()
    ids, vals, lps = top_ids.tolist(), top_vals.tolist(), token_lps.tolist()
    result: list[TokenLogprobs] = []
    for row, n in enumerate(nums):
        entry = {t: (v, rank + 1) for rank, (t, v) in enumerate(zip(ids[row][:n], vals[row][:n], strict=True))}
        entry[token_ids[row]] = (lps[row], ranks[row])
        result.append(entry)
    return result
