"""Structured outputs: grammars that constrain which tokens a request may sample.

`StructuredOutputsParams` (vLLM's names) asks for one constraint: a JSON schema, any JSON
object, a regex, a choice of strings, or a grammar (Lark, or GBNF converted to Lark).
`GrammarCompiler` turns it into a `Grammar` through llguidance, caching the compiled matcher
per constraint, so a schema used by many requests compiles once. A `Grammar` is one
sequence's matcher: before a sampling step it fills that row of a token bitmask; after it,
it accepts the sampled token; once the grammar is complete it is `terminated` and the
request finishes.

NOTE: llguidance was chosen over xgrammar and outlines-core (docs/benchmarks.md, "Structured
outputs"): the same per-token mask cost on this CPU (~7-20 us a row for a nested schema with
SmolLM2's 49,152-token vocabulary), faster compiles, Lark and regex besides JSON schema, and a
single Rust wheel where xgrammar pulls triton.

Invariants: a bitmask row allows exactly the tokens the matcher would accept; a matcher is
never shared between sequences (`fork`); JSON is compact by default (no free whitespace,
which lets small models loop on newlines until max_tokens) unless the request asks for it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.config import LimitsConfig
from pagoda.grammar_child import grammar_text
from pagoda.grammar_sandbox import GrammarSandbox, SandboxStartError, tokenizer_init

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one of the first five fields), as vLLM spells it.

    Attributes:
        json: a JSON schema (dict or JSON text).
        json_object: any JSON object.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (or a GBNF one, converted).
        disable_any_whitespace: compact JSON (pagoda's default: True).
        whitespace_pattern: a regex for the whitespace JSON may hold between tokens.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, "
                             f"choice or grammar; got {given or 'none'}.")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings.")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        return (self.kind, spec, self.disable_any_whitespace, self.whitespace_pattern)


class GrammarError(ValueError):
    """The constraint does not compile; `param` names where it came from."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


class Grammar:
    """One sequence's grammar state.

    Args:
        source: the grammar text it was compiled from (llguidance's format), with which
            another process rebuilds it (`GrammarCompiler.from_source`).
        thinking_end: a reasoning model's end of thinking (`</think>`'s tokens): until they
            are generated every token is allowed and none reaches the grammar, as vLLM applies
            a structured output after the reasoning (`after_thinking`); empty: it holds from
            the first token.
    """

    def __init__(self, matcher: Any, source: str, thinking_end: tuple[int, ...] = ()) -> None:
        self._matcher = matcher
        self.source = source
        self.thinking_end = thinking_end
        self.thinking = bool(thinking_end)
        self._last: tuple[int, ...] = ()  # NOTE: while thinking, the last len(thinking_end) tokens

    def after_thinking(self, end: tuple[int, ...]) -> Grammar:
        """This grammar (fresh, nothing accepted yet), holding only once `end` is generated."""
        return Grammar(self._matcher, self.source, end)

    def fork(self) -> Grammar:
        """An independent copy in the same state (one per sample of n > 1)."""
        twin = Grammar(self._matcher.deep_copy(), self.source, self.thinking_end)
        twin.thinking, twin._last = self.thinking, self._last
        return twin

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the allowed next tokens into `row` (int32, one bit a token; left as it is,
        every token allowed, while thinking)."""
        if not self.thinking:
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the grammar did not allow it."""
        if self.thinking:
            self._last = (*self._last, token_id)[-len(self.thinking_end):]
            self.thinking = self._last != self.thinking_end
            return True
        return bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar would accept in turn from here (state unchanged);
        none while thinking (the end of thinking could fall inside them)."""
        return 0 if self.thinking else int(self._matcher.validate_tokens(tokens))

    def fill_bitmasks_along(self, tokens: list[int], bitmask: torch.Tensor) -> None:
        """Row j of `bitmask`: the allowed tokens after accepting `tokens[:j]`, for j = 0 ..
        len(tokens) (a draft's verification rows); the state is left as it was.

        `tokens` must be a valid prefix (`valid_prefix`)."""
        self.fill_bitmask(bitmask[0])
        for j, token in enumerate(tokens, start=1):
            self._matcher.consume_token(token)
            self.fill_bitmask(bitmask[j])
        if tokens:
            self._matcher.rollback(len(tokens))

    @property
    def terminated(self) -> bool:
        return not self.thinking and bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, with an LRU cache.

    A constraint not in the cache is first compiled in the sandbox (`GrammarSandbox`, when
    `limits.grammar_compile_workers` > 0), so a grammar that crashes or hangs the library
    costs one child process, not the engine; `prepare` does it on the compiler's own threads,
    away from the ones that tokenize.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's).
        cache_size: compiled constraints kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256,
                 limits: LimitsConfig | None = None) -> None:
        self.limits = limits or LimitsConfig()
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._sandbox: GrammarSandbox | None = None
        self._executor: ThreadPoolExecutor | None = None

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> Grammar:
        """A fresh `Grammar` for `params`; raises `GrammarError` naming `param` if invalid or
        over a limit (checked before any compiling)."""
        matcher, source = self._template(params, param)
        return Grammar(matcher.deep_copy(), source)

    def from_source(self, source: str) -> Grammar:
        """A fresh `Grammar` from the text of one this process's or another's compiler made
        (`Grammar.source`): already checked and compiled once, so built here without the
        sandbox; cached like the others."""
        key = ("source", source)
        with self._lock:
            template = self._cache.get(key)
        if template is None:
            template = self._remember(key, (self._matcher_of(source, "grammar"), source))
        return Grammar(template[0].deep_copy(), source)

    async def prepare(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Compiles `params` into the cache on the compiler's own threads (so many slow
        compiles never hold the threads that tokenize); raises as `compile` does."""
        check_limits(params, self.limits, param)
        with self._lock:
            if params.cache_key() in self._cache:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max(self.limits.grammar_compile_workers, 1),
                                                    thread_name_prefix="pagoda-grammar")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._template, params, param, True)

    def _template(self, params: StructuredOutputsParams, param: str, checked: bool = False) -> Any:
        """The cached matcher of `params`, built if new; the limits are checked first (they
        also guard the cache key's JSON encoding) unless the caller just did."""
        if not checked:
            check_limits(params, self.limits, param)
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        return self._remember(key, self._build(params, param))

    def _remember(self, key: tuple, template: tuple[Any, str]) -> tuple[Any, str]:
        with self._lock:
            self._cache[key] = template
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _build(self, params: StructuredOutputsParams, param: str) -> tuple[Any, str]:
        """The matcher of `params` and the grammar text it was compiled from."""
        self._tokenizer()  # NOTE: first, as it starts the sandbox the text is made in
        try:
            grammar = self._grammar_text(params)
        except SandboxStartError:
            raise
        except Exception as e:  # noqa: BLE001 - the text is the user's: any conversion failure is theirs
            # NOTE: llguidance's GBNF converter raises its own GbnfToLarkError, and a bare
            # Exception for a grammar without a root rule (both found by the fuzzer).
            raise GrammarError(f"Invalid {params.kind} in {param}: {library_message(str(e))}", param) from e
        return self._matcher_of(grammar, f"{params.kind} in {param}", param), grammar

    def _matcher_of(self, grammar: str, what: str, param: str = "structured_outputs") -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"Invalid {what}: {library_message(matcher.get_error())}", param)
        return matcher

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar, compiled first in the sandbox when there is one."""
        spec = getattr(params, params.kind)
        if self._sandbox is None:
            return grammar_text(params.kind, spec, params.disable_any_whitespace, params.whitespace_pattern)
        return self._sandbox.grammar_text({
            "kind": params.kind, "spec": list(spec) if isinstance(spec, tuple) else spec,
            "disable_any_whitespace": params.disable_any_whitespace,
            "whitespace_pattern": params.whitespace_pattern})

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                if self._hf_tokenizer is None:
                    raise GrammarError("This model has no tokenizer: structured outputs need one.")
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer,
                                                                  n_vocab=self.vocab_size)
                limits = self.limits
                if limits.grammar_compile_workers > 0:
                    self._sandbox = GrammarSandbox(
                        tokenizer_init(self._hf_tokenizer, self.vocab_size), limits.grammar_compile_workers,
                        limits.grammar_compile_timeout, limits.grammar_compile_memory)
            return self._ll_tokenizer

    def close(self) -> None:
        """Stops the sandbox's processes and the compiler's threads."""
        if self._sandbox is not None:
            self._sandbox.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)


def library_message(text: str, limit: int = 500) -> str:
    """The grammar library's error as a user may read it: no Rust panic location or backtrace,
    at most `limit` characters."""
    for marker in ("panicked at", "<backtrace>", "stack backtrace", "Backtrace"):
        if marker in text:
            cut = text.index(marker)
            line_start = text.rfind("\n", 0, cut)
            text = text[:line_start if line_start >= 0 else cut].rstrip(" :\n")
            text = text or "the grammar compiler failed on this input"
    return text if len(text) <= limit else text[:limit] + "..."


_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(?::|::=)", re.MULTILINE)


def check_limits(params: StructuredOutputsParams, limits: LimitsConfig, param: str) -> None:
    """Refuses a constraint over a size limit, before it reaches the grammar library."""
    kind = params.kind

    def refuse(what: str, value: int, flag: str, limit: int) -> None:
        if value > limit:
            raise GrammarError(f"The {kind} in {param} has {value} {what}; the limit is {limit} "
                               f"(--{flag}).", param)

    if kind == "choice":
        assert params.choice is not None
        refuse("choices", len(params.choice), "max-guided-choices", limits.max_guided_choices)
        refuse("bytes", sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice),
               "max-grammar-bytes", limits.max_grammar_bytes)
    elif kind in ("regex", "grammar"):
        text = params.regex if kind == "regex" else params.grammar
        assert text is not None
        refuse("bytes", len(text.encode("utf-8", "surrogatepass")), "max-grammar-bytes", limits.max_grammar_bytes)
        if kind == "grammar":
            refuse("rules", len(_LARK_RULE.findall(text)), "max-grammar-rules", limits.max_grammar_rules)
    elif kind == "json" and params.json is not None:
        if isinstance(params.json, str):
            refuse("bytes", len(params.json.encode("utf-8", "surrogatepass")), "max-grammar-bytes",
                   limits.max_grammar_bytes * 16)
            try:
                schema: Any = json.loads(params.json)
            except (ValueError, RecursionError):
                return  # NOTE: the compile step reports an invalid schema text as such
        else:
            schema = params.json
        shape = schema_shape(schema, limits.max_schema_depth + 1)
        refuse("levels of nesting", shape.depth, "max-schema-depth", limits.max_schema_depth)
        if not isinstance(params.json, str):  # NOTE: its depth checked first, so dumps is safe
            try:
                size = len(json.dumps(schema).encode("utf-8", "surrogatepass"))
            except (TypeError, ValueError):
                size = 0  # NOTE: the compile step reports what is not JSON, as above
            refuse("bytes", size, "max-grammar-bytes", limits.max_grammar_bytes * 16)
        refuse("properties", shape.properties, "max-schema-properties", limits.max_schema_properties)
        refuse("enum values", shape.enum_values, "max-guided-choices", limits.max_guided_choices)


@dataclass(frozen=True)
class SchemaShape:
    """What a JSON schema costs to compile: its nesting depth, its properties (every
    `properties` object's names, summed) and its `enum` values (summed)."""

    depth: int
    properties: int
    enum_values: int


def schema_shape(value: Any, stop: int) -> SchemaShape:
    """`value`'s shape, walked without recursion; the depth counts dicts and lists (a scalar:
    0), and the walk goes no deeper than `stop`."""
    deepest, properties, enum_values, stack = 0, 0, 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth >= stop:
            break
        if isinstance(item, dict):
            if isinstance(item.get("properties"), dict):
                properties += len(item["properties"])
            if isinstance(item.get("enum"), list):
                enum_values += len(item["enum"])
        stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return SchemaShape(deepest, properties, enum_values)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, the logits whose bit is 0 (`bitmask`: int32 [rows, words])."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
