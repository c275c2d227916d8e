"""SamplingParams: how one request samples and when it stops.

Validation happens at construction; an invalid value raises `ValueError` whose message names
the parameter and the value (the server turns it into a 400 with `param` set).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pagoda.structured_output import StructuredOutputsParams
from pagoda.thinking_budget import ThinkingBudget

# NOTE: vLLM's _SAMPLING_EPS: a temperature below it is greedy (dividing logits by 5e-324
# overflows them to inf and the softmax to NaN).
SAMPLING_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
WHOLE_VOCABULARY = -1  # logprobs / prompt_logprobs: every token (vLLM's -1)
MAX_LOGPROB_TOKEN_IDS = 128  # NOTE: vLLM's bound on logprob_token_ids


class SamplingParamError(ValueError):
    """An invalid sampling value; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _short(values: list) -> str:
    """A list's repr cut to a readable length (error messages echo user input)."""
    text = repr(values)
    return text if len(text) <= 200 else text[:200] + "...]"


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM's: a request ends (finish reason "repetition") once its output ends with a pattern of
    `min_pattern_size` (0: 1) to `max_pattern_size` tokens repeated `min_count` times in a row
    (e.g. 'abcdabcdabcd'): small models loop until max_tokens otherwise. 0 disables it."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        _require(0 <= self.min_pattern_size <= self.max_pattern_size, "repetition_detection",
                 "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. "
                 "Set both to 0 to disable repetitive pattern detection.")
        _require(self.max_pattern_size == 0 or self.min_count >= 2, "repetition_detection",
                 "min_count must be >= 2 to detect repetitive patterns in engine output. If you do not "
                 "wish to detect repetitive patterns, set max_pattern_size to 0.")

    def repeats(self, tokens: list[int]) -> bool:
        """Whether `tokens` end with a pattern of an allowed size repeated `min_count` times."""
        if self.max_pattern_size == 0:
            return False
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > len(tokens):
                return False
            # NOTE: the last token against the one a pattern length before it first: most
            # sizes end there, without slicing
            if tokens[-1] == tokens[-1 - size]:
                last = tokens[-size:]
                if all(tokens[-(k + 1) * size:-k * size] == last for k in range(1, self.min_count)):
                    return True
        return False


@dataclass
class SamplingParams:
    """Sampling and stopping parameters, with vLLM's names and defaults.

    temperature 0 (or below 1e-5) means greedy. top_k -1 (or 0) disables top-k. `seed` makes the request's
    samples reproducible whatever else shares its batch. `logprobs` N returns the sampled
    token's log-probability plus the top N alternatives at each step. `prompt_logprobs` K
    returns, for every prompt token after the first, its log-probability given the tokens
    before it plus the top K (vLLM's: the first prompt token gets None); such a request takes
    no prefix-cache hits, so that its whole prompt is computed.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # NOTE: vLLM's: with `logprobs`, these tokens' log-probabilities (and the sampled one's)
    # at each position instead of the top N
    logprob_token_ids: list[int] | None = None
    # NOTE: vLLM's: whether the engine's watermark (--watermark-config) applies; None: it does.
    # InputProcessor resolves it (False for greedy requests, which cannot carry one) and
    # records the outcome for the metrics in `watermark_status`.
    watermarking: bool | None = None
    watermark_status: str | None = field(default=None, repr=False)
    # NOTE: vLLM's: words the answer may not write. `InputProcessor` tokenizes each (as written
    # and after a space, `bad_words_token_ids`); the sampler then masks a word's last token
    # wherever the output so far ends with the tokens before it.
    bad_words: list[str] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    repetition_detection: RepetitionDetectionParams | None = None
    # NOTE: vLLM's: with skip_special_tokens off, False writes special tokens that follow one
    # another as their bare text, without the space a tokenizer's decoder may put before each.
    spaces_between_special_tokens: bool = True
    # NOTE: vLLM's: a stream's tokens in chunks of at least this many (first and last at
    # once); the engine's `stream_interval` is the floor. None: the engine's.
    stream_interval: int | None = None
    # NOTE: vLLM's: a reasoning model thinks at most this many tokens, then its end of thinking
    # is forced (needs the engine's reasoning config; -1 or None: no limit). `InputProcessor`
    # resolves it with the engine's tokenized markers into `thinking_budget`.
    thinking_token_budget: int | None = None
    thinking_budget: ThinkingBudget | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))  # NOTE: vLLM drops repeats
        if isinstance(self.repetition_detection, dict):  # NOTE: the HTTP field's shape
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.top_k == 0:
            self.top_k = -1
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            self.thinking_token_budget = None  # NOTE: vLLM's "unlimited"
        self._validate()
        if self.temperature < SAMPLING_EPS:
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0
            _require(self.n == 1, "n", f"n must be 1 when using greedy sampling, got {self.n}.")

    def _validate(self) -> None:
        for name in ("n", "max_tokens", "min_tokens", "top_k", "logprobs", "prompt_logprobs"):
            # NOTE: True is an int to Python; as a count it would reach the engine as 1 or fail there
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool)), name,
                     f"{name} must be an integer, got {value!r}.")
        _require(self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"max_tokens must be at least 1, got {self.max_tokens}.")
        _require(self.min_tokens >= 0, "min_tokens",
                 f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                 f"got {self.min_tokens}.")
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                 f"temperature must be non-negative, got {self.temperature}.")
        _require(self.temperature <= 2.0, "temperature",
                 f"temperature must be in [0, 2], got {self.temperature}.")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _require(self.top_k >= -1, "top_k",
                 f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        _require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty",
                 f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"stop strings must be non-empty, got {_short(self.stop)}.")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", f"stop_token_ids must be non-negative ints, got {_short(self.stop_token_ids)}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # NOTE: the upper bound is the server's (--max-logprobs), checked by InputProcessor.
            _require(value is None or (isinstance(value, int) and value >= WHOLE_VOCABULARY), name,
                     f"{name} must be -1 (the whole vocabulary) or at least 0, got {value}.")
        _require(all(isinstance(w, str) and w for w in self.bad_words or []), "bad_words",
                 f"bad_words cannot contain an empty string, got {_short(self.bad_words or [])}.")
        self._validate_token_controls()
        budget = self.thinking_token_budget
        _require(budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0),
                 "thinking_token_budget",
                 "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.")
        _require(self.stream_interval is None or (isinstance(self.stream_interval, int)
                                                  and self.stream_interval >= 1), "stream_interval",
                 f"stream_interval must be at least 1, got {self.stream_interval}.")
        _require(self.seed is None or (isinstance(self.seed, int)
                                       and INT64_MIN <= self.seed <= INT64_MAX), "seed",
                 f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}.")

    def _validate_token_controls(self) -> None:
        bias = self.logit_bias or {}
        _require(all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias",
                 "logit_bias keys must be non-negative token ids.")
        _require(all(isinstance(v, (int, float)) and -100 <= v <= 100 for v in bias.values()),
                 "logit_bias", "logit_bias values must be in [-100, 100].")
        allowed = self.allowed_token_ids
        _require(allowed is None or (len(allowed) > 0 and all(
            isinstance(t, int) and t >= 0 for t in allowed)), "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of non-negative token ids.")
        chosen = self.logprob_token_ids
        _require(chosen is None or (0 < len(chosen) <= MAX_LOGPROB_TOKEN_IDS and all(
            isinstance(t, int) and t >= 0 for t in chosen)), "logprob_token_ids",
            f"logprob_token_ids must be 1 to {MAX_LOGPROB_TOKEN_IDS} non-negative token ids.")
        _require(chosen is None or self.logprobs is not None, "logprob_token_ids",
                 "when using `logprob_token_ids`, `logprobs` must be set.")

    @property
    def constrains_tokens(self) -> bool:
        """Whether some tokens are masked or biased before sampling."""
        return (self.structured_outputs is not None or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)
                or self.thinking_budget is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def narrows(self) -> bool:
        """Whether top-k, top-p or min-p leaves out tokens the temperature alone keeps."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the tokens before this step (penalties, bad words, a
        thinking budget, which reads the prompt too)."""
        return self.needs_penalties or bool(self.bad_words_token_ids) or self.thinking_budget is not None

    def for_child(self, index: int) -> SamplingParams:
        """The params of the index-th of n parallel samples (n=1, seed offset by index).

        NOTE: the prompt is the same for every sample: only the first scores it."""
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    def per_sample(self) -> list[SamplingParams]:
        """The params of each of the n samples (these params themselves when n is 1)."""
        return [self.for_child(i) for i in range(self.n)] if self.n > 1 else [self]
