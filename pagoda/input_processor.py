"""InputProcessor: a user's prompt and sampling params in, a validated `EngineRequest` out.

The one place where a request is checked against the model and the limits, before anything
reaches the engine core (vLLM's `Processor`):
- prompt text: at most `max_prompt_chars` characters, counted before tokenizing, and valid
  Unicode (a lone surrogate cannot be encoded);
- prompt token ids: non-empty, inside the model's vocabulary, leaving room for one token;
- sampling params: `n` up to `max_n`, stop strings and stop token ids bounded in number and
  size, stop ids inside the vocabulary, `top_k` above the vocabulary clamped to "off",
  logit_bias and allowed_token_ids inside the vocabulary; bad_words tokenized (vLLM's two
  forms a word) into at most `MAX_BAD_WORDS` sequences inside the vocabulary;
  `repetition_detection` patterns of at most `MAX_REPETITION_PATTERN` tokens; a
  `thinking_token_budget` only with the engine's reasoning markers, which it then carries;
- pooling params: `dimensions` only on a Matryoshka model (vLLM's rule), the prompt cut to
  `truncate_prompt_tokens` first; a pooled prompt may fill the whole context;
- structured outputs: compiled here (cached per constraint, in the caller's thread), so an
  invalid schema is a 400 and compiling never stalls the engine's steps.
Invariant: what `process` returns can be scheduled and sampled without an index or overflow
error, so a step never fails because of one request's inputs. Errors are `ValueError`s with a
`param` attribute (the server's 400s); a prompt without room is a `PromptTooLongError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from pagoda.config import LimitsConfig, ReasoningConfig, WatermarkConfig
from pagoda.lora import LoRARequest
from pagoda.pooling import PoolerConfig, PoolingParams
from pagoda.sampling_params import WHOLE_VOCABULARY, SamplingParamError, SamplingParams
from pagoda.structured_output import Grammar, GrammarCompiler
from pagoda.thinking_budget import ThinkingBudget, ThinkingTokens

# NOTE: vLLM's VLLM_MAX_NUM_BAD_WORDS default: the token sequences a request's bad_words may make
MAX_BAD_WORDS = 128
# NOTE: the longest repeated pattern `repetition_detection` may look for (pagoda's bound; vLLM sets none)
MAX_REPETITION_PATTERN = 256
logger = logging.getLogger("pagoda")


class PromptTooLongError(ValueError):
    """The prompt leaves no room for even one output token."""

    param = "prompt"

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the input.")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


@dataclass
class EngineRequest:
    """A validated request, ready for `LLMEngine.add_processed`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    grammar: Grammar | None = None
    priority: int = 0
    group: str | None = None  # requests that share one share the scheduler's turns
    pooling_params: PoolingParams | None = None  # a pooled request (pooling.py): no tokens
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes
    lora_request: LoRARequest | None = None  # the adapter it runs with (lora.py)
    # NOTE: a reasoning model's end of thinking (`</think>`'s tokens): the grammar holds after it
    reasoning_end: tuple[int, ...] = ()


def thinking_tokens(tokenizer: Any, reasoning: ReasoningConfig | None,
                    vocab_size: int) -> ThinkingTokens | None:
    """The reasoning markers as token ids (vLLM's `ReasoningConfig.initialize_token_ids`), or
    None where no budget can be enforced (no config, or a start or end string unset).

    Raises:
        ValueError: a string makes no token, or a token outside the model's vocabulary.
    """
    if reasoning is None or not reasoning.enabled or tokenizer is None:
        return None
    texts = (reasoning.reasoning_start_str, reasoning.reasoning_end_str,
             reasoning.natural_end_str or reasoning.reasoning_end_str)
    ids = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    if not all(ids) or any(t >= vocab_size for seq in ids for t in seq):
        raise ValueError(f"reasoning_config: failed to tokenize the reasoning strings {texts!r} into "
                         f"tokens of the model's vocabulary (size {vocab_size}).")
    return ThinkingTokens(*ids)


def check_unicode(text: str, param: str) -> None:
    """Raises a 400-style error if `text` holds a lone surrogate (JSON allows '\\ud800')."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SamplingParamError(
            param, f"{param} is not valid Unicode: a lone surrogate at position {e.start}.") from None


class InputProcessor:
    """Validates and tokenizes requests for one engine.

    Args:
        tokenizer: a Hugging Face tokenizer, or None (token-id prompts only).
        vocab_size: the model's vocabulary (its embedding rows): valid ids are below it.
        max_model_len: the context length.
        limits: resolved limits (`LimitsConfig.resolved`).
        scheduling_policy: the scheduler's; a nonzero `priority` needs "priority".
        pooler: the model's embedding width and Matryoshka support (pooled requests).
        watermark: the engine's watermark, if any (requests resolve whether they carry it).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 limits: LimitsConfig, scheduling_policy: str = "fcfs",
                 pooler: PoolerConfig | None = None, watermark: WatermarkConfig | None = None,
                 reasoning: ReasoningConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.watermark = watermark
        self._warned: dict[str, bool] = {}
        self.pooler = pooler or PoolerConfig(0)
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits
        self.max_prompt_chars = limits.max_prompt_chars or 32 * max_model_len
        self.max_n = limits.max_n or 1
        self.thinking_tokens = thinking_tokens(tokenizer, reasoning, vocab_size)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, limits=limits)

    # ---- text ----------------------------------------------------------------------------
    def check_text(self, text: str, param: str = "prompt") -> None:
        """Size and Unicode checks of a prompt text, before any tokenizing."""
        self.check_num_chars(len(text), param)
        check_unicode(text, param)

    def check_num_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise SamplingParamError(
                param, f"The {param} has {num_chars} characters, more than this server accepts "
                       f"({self.max_prompt_chars}, --max-prompt-chars); the context holds "
                       f"{self.max_model_len} tokens.")

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
        """Checks `text`, then tokenizes it (may take a while: call it off the event loop)."""
        if self.tokenizer is None:
            raise SamplingParamError(param, "This model has no tokenizer: pass prompt token ids.")
        self.check_text(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # ---- token ids and params --------------------------------------------------------------
    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise SamplingParamError(param, f"The {param} cannot be empty.")
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)),
                   None)
        if bad is not None:
            raise SamplingParamError(
                param, f"Token id {bad} is out of vocabulary (size {self.vocab_size}).")

    def check_prompt(self, token_ids: list[int], pooled: bool = False) -> None:
        """Ids inside the vocabulary, leaving room for one token (a pooled prompt, which
        generates none, may fill the whole context)."""
        self.check_token_ids(token_ids, "prompt")
        if len(token_ids) > self.max_model_len - (0 if pooled else 1):
            raise PromptTooLongError(len(token_ids), self.max_model_len)

    @staticmethod
    def check_cache_salt(cache_salt: str | None) -> None:
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise SamplingParamError("cache_salt", "cache_salt must be a non-empty string.")

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.scheduling_policy != "priority":
            raise SamplingParamError(
                "priority", f"Got priority {priority} but priority scheduling is not enabled "
                            "(--scheduling-policy priority).")

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Checks `params` against the model and the limits; returns them, maybe clamped."""
        limits = self.limits
        if params.n > self.max_n:
            raise SamplingParamError("n", f"n must be at most {self.max_n} (--max-n), got {params.n}.")
        for name, values in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids)):
            if len(values) > limits.max_stop_sequences:
                raise SamplingParamError(
                    name, f"{name} may hold at most {limits.max_stop_sequences} entries "
                          f"(--max-stop-sequences), got {len(values)}.")
        for stop in params.stop:
            if len(stop) > limits.max_stop_str_chars:
                raise SamplingParamError(
                    "stop", f"stop strings may be at most {limits.max_stop_str_chars} characters "
                            f"(--max-stop-str-chars), got one of {len(stop)}.")
            check_unicode(stop, "stop")
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise SamplingParamError(
                "stop_token_ids", f"Stop token id {bad} is out of vocabulary (size {self.vocab_size}).")
        self._check_token_controls(params)
        detection = params.repetition_detection
        if detection is not None and detection.max_pattern_size > MAX_REPETITION_PATTERN:
            # NOTE: the check after each token tries every size up to it (those the output can
            # hold): a huge one would cost every step of the batch, not only this request
            raise SamplingParamError(
                "repetition_detection", f"repetition_detection.max_pattern_size may be at most "
                                        f"{MAX_REPETITION_PATTERN}, got {detection.max_pattern_size}.")
        params = self._resolve_bad_words(params)
        params = self._resolve_thinking_budget(params)
        params = self._check_logprobs(params)
        params = self._resolve_watermarking(params)
        if params.top_k >= self.vocab_size:
            # NOTE: vLLM treats a top_k at or above the vocabulary as "off"; a huge value (2**63,
            # 1e30) would otherwise overflow the sampler's int64 tensor.
            params = dataclasses.replace(params, top_k=-1)
        return params

    def _resolve_watermarking(self, params: SamplingParams) -> SamplingParams:
        """vLLM's rule: with a watermark configured, every request carries it unless it says
        `watermarking: false` or is greedy (whose argmax has no randomness to replace: it
        samples as usual, counted as "skipped"); without one, nothing does."""
        if self.watermark is None:
            if params.watermarking and not self._warned.get("unconfigured"):
                self._warned["unconfigured"] = True
                logger.warning("A request asked for watermarking, but this server has no "
                               "--watermark-config; such requests run without a watermark.")
            return dataclasses.replace(params, watermarking=False) if params.watermarking else params
        asked = params.watermarking is not False
        applied = asked and not params.greedy
        if asked and not applied and not self._warned.get("greedy"):
            self._warned["greedy"] = True
            logger.warning("Watermarking is enabled, but greedy decoding (temperature=0) cannot be "
                           "watermarked: greedy requests use ordinary greedy sampling.")
        status = "watermarked" if applied else "skipped" if asked else "not_watermarked"
        return dataclasses.replace(params, watermarking=applied, watermark_status=status)

    def _check_logprobs(self, params: SamplingParams) -> SamplingParams:
        """logprobs and prompt_logprobs within --max-logprobs; a -1 (the whole vocabulary,
        where the limit is -1 too) becomes the vocabulary's size."""
        flag = self.limits.max_logprobs
        limit = self.vocab_size if flag == WHOLE_VOCABULARY else flag
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            asked = self.vocab_size if value == WHOLE_VOCABULARY else value
            if asked is not None and asked > limit:
                note = " (-1, the whole vocabulary, needs --max-logprobs -1)" if value == WHOLE_VOCABULARY else ""
                raise SamplingParamError(name, f"{name} must be in [0, {limit}] (--max-logprobs {flag}), "
                                               f"got {value}{note}.")
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs")
                 if getattr(params, name) == WHOLE_VOCABULARY}
        return dataclasses.replace(params, **whole) if whole else params  # type: ignore[arg-type]

    def _resolve_thinking_budget(self, params: SamplingParams) -> SamplingParams:
        """vLLM's `thinking_token_budget` with the engine's tokenized reasoning markers."""
        if params.thinking_token_budget is None:
            return dataclasses.replace(params, thinking_budget=None) if params.thinking_budget else params
        if self.thinking_tokens is None:
            # NOTE: vLLM's words
            raise SamplingParamError(
                "thinking_token_budget", "thinking_token_budget is set but reasoning_config is not "
                "configured. Please set --reasoning-parser and/or --reasoning-config to use "
                "thinking_token_budget.")
        return dataclasses.replace(params, thinking_budget=ThinkingBudget(params.thinking_token_budget,
                                                                          self.thinking_tokens))

    def _resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """vLLM's `update_from_tokenizer`: each bad word's tokens as written (its leading spaces
        stripped), and after a space where that starts with another token of as many tokens
        (a word mid-text); at most `MAX_BAD_WORDS` sequences, every id inside the vocabulary."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise SamplingParamError("bad_words", "bad_words needs the model's tokenizer.")
        if len(params.bad_words) > MAX_BAD_WORDS:  # NOTE: each word makes a sequence at least
            raise SamplingParamError("bad_words", f"Too many bad words: {len(params.bad_words)}. "
                                                  f"The max number is {MAX_BAD_WORDS}.")
        found: list[tuple[int, ...]] = []
        for word in params.bad_words:
            if len(word) > self.limits.max_stop_str_chars:
                raise SamplingParamError(
                    "bad_words", f"bad words may be at most {self.limits.max_stop_str_chars} characters "
                                 f"(--max-stop-str-chars), got one of {len(word)}.")
            check_unicode(word, "bad_words")
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise SamplingParamError("bad_words", "bad_words entries must tokenize to at least one token.")
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            found.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                found.append(spaced)
        if len(found) > MAX_BAD_WORDS:
            raise SamplingParamError("bad_words", f"Too many bad words after tokenization: {len(found)}. "
                                                  f"The max number is {MAX_BAD_WORDS}.")
        outside = [t for ids in found for t in ids if t >= self.vocab_size]
        if outside:
            raise SamplingParamError("bad_words", f"The model vocabulary size is {self.vocab_size}, but the "
                                                  f"following tokens were specified as bad: {outside}.")
        return dataclasses.replace(params, bad_words_token_ids=tuple(found))

    def _check_token_controls(self, params: SamplingParams) -> None:
        bias = params.logit_bias or {}
        if len(bias) > self.limits.max_logit_bias:
            raise SamplingParamError(
                "logit_bias", f"logit_bias may hold at most {self.limits.max_logit_bias} "
                              f"entries (--max-logit-bias), got {len(bias)}.")
        for name, ids in (("logit_bias", list(bias)),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logprob_token_ids", params.logprob_token_ids or [])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise SamplingParamError(
                    name, f"Token id {bad} in {name} is out of vocabulary (size {self.vocab_size}).")

    # ---- the whole request ---------------------------------------------------------------
    async def prepare_grammar(self, params: SamplingParams,
                              structured_param: str = "structured_outputs") -> None:
        """Compiles the request's constraint, if any, into the cache on the compiler's own
        threads; `process` then finds it there. Raises `GrammarError` as `process` would."""
        if params.structured_outputs is not None:
            await self.grammars.prepare(params.structured_outputs, structured_param)

    def close(self) -> None:
        self.grammars.close()

    def process_pooling(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                        arrival_time: float | None = None, prompt_text: str | None = None,
                        priority: int = 0, group: str | None = None,
                        cache_salt: str | None = None) -> EngineRequest:
        """Tokenizes (when given text), truncates and validates one pooled request.

        Raises:
            ValueError: with `param` naming the offending field.
            PromptTooLongError: the prompt is longer than the context.
        """
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            token_ids = token_ids[-keep:]
        self.check_priority(priority)
        self.check_prompt(token_ids, pooled=True)
        self.check_cache_salt(cache_salt)
        self.pooler.check(params)
        return EngineRequest(request_id, token_ids, SamplingParams(max_tokens=1),
                             time.time() if arrival_time is None else arrival_time, prompt_text,
                             None, priority, group, params, cache_salt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None, prompt_text: str | None = None,
                structured_param: str = "structured_outputs", priority: int = 0,
                group: str | None = None, cache_salt: str | None = None,
                lora_request: LoRARequest | None = None, reasoning_end: tuple[int, ...] = ()) -> EngineRequest:
        """Tokenizes (when given text), validates and compiles one request's constraint.

        Args:
            structured_param: the request field a grammar error names (e.g. response_format).
            priority: vLLM's (lower is sooner); only under the "priority" policy.
            group: the requests one client sent at once share one (default: this request).
            cache_salt: vLLM's; only requests with the same salt share cached prefixes.
            lora_request: the LoRA adapter it runs with (the engine core loads and checks it).
            reasoning_end: the tokens that end a reasoning model's thinking, after which the
                constraint holds (none: from the first token).

        Raises:
            ValueError: with `param` naming the offending field.
            PromptTooLongError: no room for one output token.
        """
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
        self.check_priority(priority)
        self.check_prompt(token_ids)
        self.check_cache_salt(cache_salt)
        params = self.check_params(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs, structured_param)
        return EngineRequest(request_id, token_ids, params,
                             time.time() if arrival_time is None else arrival_time, prompt_text,
                             grammar, priority, group, cache_salt=cache_salt, lora_request=lora_request,
                             reasoning_end=reasoning_end if grammar is not None else ())
