"""Watermark: vLLM's Gumbel-max text watermark, generated and detected (`--watermark-config`).

A watermarked request samples its token as argmax over the vocabulary of (processed logits +
Gumbel noise), where the noise is not random but a keyed pseudorandom function of the last
`context_width` generated tokens and the candidate token: Philox4x32-10 (Salmon et al., SC'11),
exactly as vLLM 0.32's `PhiloxPRF`, so the tokens follow the request's sampling distribution
and a detector holding the key finds them improbably favoured by the function. The same bits
as vLLM's: vLLM's `GumbelWatermarkDetector` detects pagoda's watermark and this module's
detector vLLM's (`docs/benchmarks/watermark/`).

Greedy requests cannot be watermarked (the argmax has no randomness to replace) and sample as
usual; so do contexts seen before in the same answer (`deduplicate_contexts`, as vLLM: a
repeated context would repeat its noise, which breeds loops). "dual_key_gumbel" picks key A or
B (derived from the key) per token with probability alpha.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.config import WatermarkConfig
from pagoda.layers import cpu_kernels

if TYPE_CHECKING:
    from pagoda.request import Request

_UINT32 = 2**32 - 1
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_CONTEXT_DOMAIN, _TOKEN_DOMAIN = 0x574D4358, 0x574D544B

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def derive_key(key: int, domain: bytes) -> int:
    """vLLM's `derive_watermark_key`: a sub-key (dual-key's "key_a" / "key_b")."""
    return int.from_bytes(hashlib.sha256(domain + key.to_bytes(8, "big")).digest()[:8], "big")


# ---- the pseudorandom function --------------------------------------------------------------


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of multiplier * x, in int64 by 16-bit halves (no overflow)."""
    xl, xh = x & 0xFFFF, x >> 16
    ml, mh = multiplier & 0xFFFF, multiplier >> 16
    cross = xh * ml + xl * mh
    low = xl * ml + ((cross & 0xFFFF) << 16)
    high = (xh * mh + (cross >> 16) + (low >> 32)) & _UINT32
    return high, low & _UINT32


def philox4x32_10(counter: Words, key: tuple[torch.Tensor | int, torch.Tensor | int]) -> Words:
    """Philox4x32-10 on int64 tensors holding uint32 words (elementwise, broadcast)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = (hi1 ^ c1 ^ k0) & _UINT32, lo1, (hi0 ^ c3 ^ k1) & _UINT32, lo0
        if round_index != 9:
            k0, k1 = (k0 + _W0) & _UINT32, (k1 + _W1) & _UINT32
    return c0, c1, c2, c3


def _context_state(key: int, contexts: torch.Tensor) -> Words:
    """Each row's context (int64 [rows, width], -1 before the answer's start) absorbed four
    tokens at a time into a 4-word state."""
    rows, width = contexts.shape
    words = contexts & _UINT32
    k0, k1 = key & _UINT32, key >> 32

    def full(value: int) -> torch.Tensor:
        return torch.full((rows,), value, dtype=torch.int64, device=contexts.device)

    state: Words = (full(_CONTEXT_DOMAIN), full(width), full(0), full(0))
    for offset in range(0, width, 4):
        block = [words[:, offset + i] if offset + i < width else full(_UINT32 - i) for i in range(4)]
        counter = tuple((s ^ b) & _UINT32 for s, b in zip(state, block, strict=True))
        key_words = (full((k0 ^ offset) & _UINT32), full(k1))
        state = philox4x32_10(counter, key_words)  # type: ignore[arg-type]
    return state


def _to_uniform(words: torch.Tensor) -> torch.Tensor:
    """vLLM's `uint32_to_uniform`: the top 24 bits, in (0, 1)."""
    return (((words >> 8).to(torch.float64) + 1.0) / (2**24 + 1)).to(torch.float32)


def philox_uniform(key: int, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] uniforms, one per (row's context, token): vLLM's `PhiloxPRF.uniform`
    bit for bit. One Philox call makes four tokens' words (token t is word t % 4 of counter
    t // 4, as vLLM's), so each counter is run once, not once per token."""
    s0, s1, s2, s3 = (w[:, None] for w in _context_state(key, contexts.to(torch.int64)))
    groups = torch.arange(-(-vocab_size // 4), dtype=torch.int64, device=contexts.device)[None, :]
    k0, k1 = key & _UINT32, key >> 32
    out = philox4x32_10((groups.expand(s0.shape[0], -1), s0, s1, s2), ((k0 ^ s3) & _UINT32, k1 ^ _TOKEN_DOMAIN))
    words = torch.stack(out, dim=-1).reshape(s0.shape[0], -1)[:, :vocab_size]
    return _to_uniform(words)


def token_uniforms(key: int, contexts: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The uniform of each (context row, token) pair: what a detector scores."""
    s0, s1, s2, s3 = _context_state(key, contexts.to(torch.int64))
    tokens = token_ids.to(torch.int64) & _UINT32
    k0, k1 = key & _UINT32, key >> 32
    out = philox4x32_10((tokens >> 2, s0, s1, s2), ((k0 ^ s3) & _UINT32, torch.full_like(s0, k1 ^ _TOKEN_DOMAIN)))
    words = torch.stack(out, dim=-1).gather(1, (tokens & 3)[:, None]).squeeze(1)
    return _to_uniform(words)


# ---- generation ----------------------------------------------------------------------------


def _noise(uniforms: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of PRF uniforms, as vLLM computes it."""
    return -uniforms.clamp_min(torch.finfo(torch.float32).tiny).log().neg().log()


def gumbel_argmax(key: int, logits: torch.Tensor, contexts: torch.Tensor) -> list[int]:
    """argmax(logits + noise) over the whole vocabulary: vLLM's `GumbelWatermarker` (the
    uniforms on the CPU kernels where they run: 0.11 ms a row of 49,152 tokens on one thread
    against 3.7 ms in torch's int64 arithmetic, docs/benchmarks/sampling/draw_time.py)."""
    logits = logits.float().nan_to_num(nan=float("-inf"))
    if cpu_kernels.takes(logits):
        uniforms = cpu_kernels.ops.philox_uniform(key, contexts, logits.shape[-1])
    else:
        uniforms = philox_uniform(key, contexts.to(logits.device), logits.shape[-1])
    return (logits + _noise(uniforms)).argmax(dim=-1).tolist()


class Watermarker:
    """Samples watermarked tokens: argmax(logits + Gumbel noise of the PRF)."""

    def __init__(self, config: WatermarkConfig) -> None:
        self.config = config
        self.keys: tuple[int, ...] = (config.key,)
        if config.algorithm == "dual_key_gumbel":
            self.keys = (derive_key(config.key, b"key_a"), derive_key(config.key, b"key_b"))

    @property
    def context_width(self) -> int:
        return self.config.context_width

    def sample(self, logits: torch.Tensor, contexts: list[tuple[int, ...]],
               generators: list[torch.Generator | None]) -> list[int]:
        """Tokens for rows of processed logits (temperature applied, filtered tokens -inf),
        one context each; dual-key draws its key per row from the row's generator (a seeded
        request's own)."""
        ctx = torch.tensor(contexts, dtype=torch.int64).reshape(len(contexts), self.context_width)
        key_rows = [self._key_index(g) for g in generators]
        tokens = [0] * len(contexts)
        for index, key in enumerate(self.keys):
            rows = [i for i, k in enumerate(key_rows) if k == index]
            if rows:
                for i, token in zip(rows, gumbel_argmax(key, logits[rows], ctx[rows]), strict=True):
                    tokens[i] = token
        return tokens

    def _key_index(self, generator: torch.Generator | None) -> int:
        if len(self.keys) == 1 or self.config.alpha == 0.0:
            return 0
        if self.config.alpha == 1.0:
            return 1
        return int(torch.rand((), generator=generator).item() < self.config.alpha)


class ContextHistory:
    """One sequence's watermark contexts: the context of its next token, or None where that
    token samples without the watermark (a context seen in the searched history, or, under
    "all", one not yet `context_width` generated tokens long). Contexts seen are remembered
    with their last position, so each step adds only its new tokens."""

    def __init__(self, config: WatermarkConfig) -> None:
        self.width = config.context_width
        self.scope = config.deduplicate_contexts
        self.max_history = config.deduplicate_contexts_max_history
        self._last_seen: dict[tuple[int, ...], int] = {}
        self._window: list[int] = [-1] * self.width
        self._num_seen = 0

    def next_context(self, request: Request) -> tuple[int, ...] | None:
        output = request.output_token_ids
        num_output = len(output)
        context = tuple([-1] * max(self.width - num_output, 0) + output[max(num_output - self.width, 0):])
        if self.scope == "none":
            return context
        if self.scope == "all" and num_output < self.width:
            return None
        history = request.all_token_ids if self.scope == "all" else output
        self._remember(history)
        start = 0 if self.max_history is None else max(len(history) - self.max_history, 0)
        return None if self._last_seen.get(context, -1) >= start else context

    def _remember(self, history: list[int]) -> None:
        """Records the context before each history position not recorded yet."""
        for position in range(self._num_seen, len(history)):
            self._last_seen[tuple(self._window)] = position
            self._window = [*self._window[1:], history[position]]
        self._num_seen = len(history)


# ---- detection -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WatermarkDetection:
    score: float
    p_value: float
    num_scored_tokens: int
    is_watermarked: bool


def gamma_survival(score: float, shape: int) -> float:
    """P(X > score) for X ~ Gamma(shape, 1), integer shape: the sum of `shape` Exp(1) scores."""
    if shape <= 0 or score <= 0:
        return 1.0
    log_score = math.log(score)
    terms = [0.0]
    for index in range(1, shape):
        terms.append(terms[-1] + log_score - math.log(index))
    top = max(terms)
    log_sum = top + math.log(sum(math.exp(t - top) for t in terms))
    return min(1.0, math.exp(min(0.0, -score + log_sum)))


class WatermarkDetector:
    """Whether token ids carry the watermark of `config`'s key: each scored token adds
    -log(1 - u) (Exp(1) without the watermark, larger with it), tested against Gamma(n, 1);
    vLLM's `GumbelWatermarkDetector` (dual-key: the keys' scores weighted 1 - alpha and alpha)."""

    def __init__(self, config: WatermarkConfig, p_value_threshold: float = 0.01,
                 deduplicate_contexts: bool = True) -> None:
        if not 0 < p_value_threshold < 1:
            raise ValueError("p_value_threshold must be between 0 and 1")
        self.config = config
        self.keys = Watermarker(config).keys
        self.p_value_threshold = p_value_threshold
        self.deduplicate_contexts = deduplicate_contexts

    def detect(self, token_ids: list[int]) -> WatermarkDetection:
        """Scores an answer's token ids (the generated ones, from the first)."""
        contexts, targets = self._scored(token_ids)
        if not targets:
            return WatermarkDetection(0.0, 1.0, 0, False)
        ctx = torch.tensor(contexts, dtype=torch.int64)
        tgt = torch.tensor(targets, dtype=torch.int64)
        scores = [-torch.log1p(-token_uniforms(key, ctx, tgt).to(torch.float64)) for key in self.keys]
        score, p_value = self._combine(scores, len(targets))
        return WatermarkDetection(score, p_value, len(targets), p_value <= self.p_value_threshold)

    def _scored(self, token_ids: list[int]) -> tuple[list[tuple[int, ...]], list[int]]:
        width = self.config.context_width
        window: list[int] = [-1] * width
        seen: set[tuple[int, ...]] = set()
        contexts, targets = [], []
        for token in token_ids:
            context = tuple(window)
            if not self.deduplicate_contexts or context not in seen:
                seen.add(context)
                contexts.append(context)
                targets.append(token)
            window = [*window[1:], token]
        return contexts, targets

    def _combine(self, scores: list[torch.Tensor], num: int) -> tuple[float, float]:
        if len(scores) == 1:
            score = float(scores[0].sum())
            return score, gamma_survival(score, num)
        alpha = self.config.alpha
        score = float(((1 - alpha) * scores[0] + alpha * scores[1]).sum())
        variance = (1 - alpha) ** 2 + alpha**2
        if alpha in (0.0, 0.5, 1.0):
            return score, gamma_survival(score / variance, round(num / variance))
        shape = torch.tensor(num / variance, dtype=torch.float64)
        return score, float(torch.special.gammaincc(shape, torch.tensor(score / variance, dtype=torch.float64)))
