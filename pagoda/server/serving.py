"""What completions and chat share: the server context, prompts, and running a generation.

A `Generation` sends an API request's prompts to the engine, one engine request per prompt
(each with its n samples), merges their delta streams and keeps the running state of every
choice (choice index = prompt index * n + sample index). If it stops before the engine
finished (a client disconnect, an error), it aborts the unfinished engine requests, so their
KV blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.async_engine import EngineDeadError, QueueFullError, StreamCutError
from pagoda.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    live_beams,
)
from pagoda.generation_config import GenerationDefaults
from pagoda.input_processor import EngineRequest, InputProcessor
from pagoda.lora import LoRARequest
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagoda.pooling import PoolingParams
from pagoda.sampling_params import WHOLE_VOCABULARY, SamplingParams
from pagoda.server.constraints import check_supported, logit_bias, structured_constraint
from pagoda.server.errors import APIError, bad_request, context_length_error
from pagoda.server.protocol import (
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
    now,
    random_id,
)
from pagoda.server.reasoning import ReasoningParser
from pagoda.server.request_logger import RequestLogger
from pagoda.server.response_store import ResponseStore
from pagoda.server.streaming import merge, until_disconnect
from pagoda.server.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024**2


class EngineClient(Protocol):
    """The part of `pagoda.async_engine.AsyncLLM` the server uses."""

    tokenizer: Any
    config: Any
    processor: InputProcessor
    dead_reason: str | None
    eos_token_ids: set[int]

    def generate_request(self, req: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def check_queue(self, num_sequences: int) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def add_lora(self, lora_request: LoRARequest) -> None: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    def cut_streams(self, reason: str) -> int: ...

    def check_health(self) -> tuple[bool, str]: ...

    def num_unfinished_requests(self) -> int: ...

    def kv_report(self) -> dict[str, float]: ...

    def record_rejection(self, reason: str) -> None: ...


# NOTE: --chat-template-content-format, as vLLM: how a message's content reaches the template.
CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass
class ServerContext:
    """Everything a route needs: the engine, the names it answers to, the limits, the
    tool-call parser of "auto" (`--enable-auto-tool-choice --tool-call-parser`), whether
    logprobs name their tokens as "token_id:N" (`--return-tokens-as-token-ids`), the
    stored responses (`--responses-store-size`), and the sampling defaults of fields a request
    leaves out (`--generation-config`)."""

    engine: EngineClient
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)  # NOTE: --lora-modules by name
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"  # NOTE: a chat answer's role after a generation prompt
    exclude_tools_when_tool_choice_none: bool = False
    # NOTE: --enable-force-include-usage: usage in every chunk of every stream and a usage chunk
    # at its end, whatever stream_options say (vLLM's should_include_usage)
    force_include_usage: bool = False
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    api_keys: list[str] = field(default_factory=list)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    draining: bool = False
    num_active_requests: int = 0
    # NOTE: vLLM's --enable-server-load-tracking: model-running calls in flight (`GET /load`)
    enable_server_load_tracking: bool = False
    enable_scale_out: bool = False  # NOTE: vLLM's --enable-scale-out: the token-in, token-out routes
    tokens_only: bool = False  # NOTE: vLLM's --tokens-only: those routes with token ids only
    enable_tokenizer_info: bool = False  # NOTE: vLLM's --enable-tokenizer-info-endpoint
    # NOTE: whether the chat template refuses system messages in mid-conversation (probed once
    # by /v1/messages, which then merges them into the first, as vLLM's)
    merge_inline_system: bool | None = None
    server_load: int = 0
    return_tokens_as_token_ids: bool = False
    request_logger: RequestLogger | None = None  # NOTE: --enable-log-requests
    # NOTE: the engine ids of the requests running under each response id (`abort_requests`)
    running: dict[str, list[str]] = field(default_factory=dict)
    # NOTE: the background responses being generated, by response id (responses.py)
    background: dict[str, asyncio.Task] = field(default_factory=dict)
    response_store: ResponseStore = field(default_factory=ResponseStore)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def processor(self) -> InputProcessor:
        return self.engine.processor

    def check_model(self, name: str | None) -> None:
        """Refuses a model this route does not serve (LoRA adapters: `lora_for`'s routes only)."""
        if name is not None and name in self.lora_requests:
            raise APIError(400, f"`{name}` is a LoRA adapter: adapters are served on "
                                "/v1/completions, /v1/chat/completions and /v1/responses.", "model")
        if name is not None and name not in self.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); refuses unknown names."""
        if name is not None and name in self.lora_requests:
            return self.lora_requests[name]
        self.check_model(name)
        return None


def check_lora_model(ctx: ServerContext, name: str | None, beam_search: bool) -> LoRARequest | None:
    """The adapter a generating request's `model` names; refuses unknown names, and beam
    search with an adapter."""
    lora = ctx.lora_for(name)
    if lora is not None and beam_search:
        raise APIError(400, "use_beam_search with a LoRA adapter is not supported.", "use_beam_search")
    return lora


def load_chat_template(template: str | None) -> str | None:
    """A `--chat-template` value is either a file path or the template text itself."""
    if template and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template


@dataclass
class Prompt:
    """One engine prompt: its tokens and, when the client sent text, that text."""

    token_ids: list[int]
    text: str | None = None


def invalid_input(e: ValueError | TypeError) -> APIError:
    """An `InputProcessor` / `SamplingParams` error as the 400 the client gets."""
    return bad_request(str(e), getattr(e, "param", None))


async def tokenize_text(ctx: ServerContext, text: str, add_special_tokens: bool = True,
                        param: str = "prompt") -> list[int]:
    """Checks and tokenizes `text` in a worker thread, so a long prompt never blocks the loop."""
    try:
        return await asyncio.to_thread(ctx.processor.tokenize, text, add_special_tokens, param)
    except ValueError as e:
        raise invalid_input(e) from e


def request_fields(req: SamplingFields) -> tuple[dict[str, Any], str]:
    """The request's `SamplingParams` keywords (constraints included) and the field a grammar
    error names; refuses unknown fields (400)."""
    check_supported(req)
    if req.stream_options is not None and not req.stream:
        # NOTE: vLLM's answer, word for word: a client that sets it expects a stream.
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if req.logprob_token_ids and req.use_beam_search:
        raise bad_request("`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
    if req.stream and req.prompt_logprobs is not None and req.prompt_logprobs != 0:
        # NOTE: vLLM's rule and words; echo with logprobs still streams the prompt's scores.
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                          "prompt_logprobs")
    structured, param = structured_constraint(req)
    fields = req.sampling_kwargs()
    fields.update(structured_outputs=structured, logit_bias=logit_bias(req))
    return fields, param


def truncate_prompt(prompt: Prompt, keep: int | None, max_model_len: int,
                    side: str | None = None) -> Prompt:
    """vLLM's `truncate_prompt_tokens`: only `keep` tokens (-1: the context length), the last
    ones (`truncation_side` "left", the default) or the first ("right")."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or positive.", "truncate_prompt_tokens")
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(prompt.token_ids[:keep] if side == "right" else prompt.token_ids[-keep:])


def build_sampling_params(ctx: ServerContext, fields: dict[str, Any], num_prompt_tokens: int,
                          max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Checks the context length, then builds SamplingParams; both fail with a 400.

    Omitted fields take the generation config's defaults; an omitted max_tokens its
    max_new_tokens, else whatever the context leaves after the prompt.
    """
    error = context_length_error(ctx.max_model_len, num_prompt_tokens, max_tokens)
    if error is not None:
        raise error
    defaults = ctx.generation_defaults
    max_tokens = defaults.max_tokens(max_tokens, ctx.max_model_len - num_prompt_tokens)
    try:
        return SamplingParams(**defaults.fill(fields), max_tokens=max_tokens, logprobs=logprobs)
    except (TypeError, ValueError) as e:
        raise invalid_input(e) from e


@dataclass
class ChoiceState:
    """Everything one choice (one sample of one prompt) produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


def admit(ctx: ServerContext, num_sequences: int) -> None:
    """Refuses a request whose sequences the queue cannot take (400 if it never could)."""
    limit = ctx.engine.config.limits.max_queued_requests
    if num_sequences > limit:
        raise bad_request(f"This request asks for {num_sequences} sequences (prompts x n); the "
                          f"server queues at most {limit} (--max-queued-requests).", "n")
    try:
        ctx.engine.check_queue(num_sequences)
    except QueueFullError as e:
        raise queue_full(ctx, e) from e


def queue_full(ctx: ServerContext, e: QueueFullError) -> APIError:
    ctx.engine.record_rejection("queue_full")
    return APIError(429, str(e), headers={"Retry-After": str(e.retry_after)})


_background_tasks: set[asyncio.Task[None]] = set()


async def _abort_quietly(engine: EngineClient, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:  # NOTE: the request may have finished meanwhile; nothing to undo.
        logger.debug("abort of %s failed", request_id, exc_info=True)


@dataclass(frozen=True)
class RequestIds:
    """An API request's ids: its responses' `id`, and the engine's (unique, even where clients
    send the same id twice)."""

    response: str
    engine: str


def api_request_ids(prefix: str, raw: Any, given: str | None) -> RequestIds:
    """vLLM's: the responses' id is `{prefix}-{X-Request-Id}` (the header), else
    `{prefix}-{request_id}` (the body's field), else `{prefix}-` and a random one; a client's id
    gets 8 random hex digits more in the engine, as vLLM's internal ids do."""
    base = raw.headers.get("x-request-id") or given
    if not base:
        rid = random_id(prefix)
        return RequestIds(rid, rid)
    return RequestIds(f"{prefix}-{base}", f"{prefix}-{base}-{uuid.uuid4().hex[:8]}")


class Generation:
    """One API request's prompts running in the engine, with the state of each choice.

    `Generation.create` validates every prompt with its params and compiles its output
    constraint in a worker thread (400s), and checks that the queue has room for all their
    sequences (429), before any response starts.
    """

    def __init__(self, ctx: ServerContext, request_id: str, prompts: list[Prompt],
                 requests: list[EngineRequest], response_id: str | None = None) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.response_id = response_id or request_id  # NOTE: the body's `id` (`api_request_ids`)
        self.created = now()
        self.prompts = prompts
        self.requests = requests
        self.n = requests[0].sampling_params.n
        self.choices = [ChoiceState() for _ in range(len(prompts) * self.n)]
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        self.num_cached_tokens = [0] * len(prompts)
        self.finished = [False] * len(prompts)
        self.pooled: list[list[float] | None] = [None] * len(prompts)  # pooled requests' vectors

    @classmethod
    async def create(cls, ctx: ServerContext, request_id: str, prompts: list[Prompt],
                     params: list[SamplingParams], structured_param: str = "structured_outputs",
                     priority: int = 0, user: str | None = None,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                     reasoning_end: tuple[int, ...] = (), response_id: str | None = None) -> Generation:
        """Validates and compiles every prompt's request. The prompts share one scheduling
        group (they take turns with other requests), and so do all requests naming the same
        OpenAI `user`: one client's many requests cannot starve another's. `cache_salt`: only
        requests with the same salt share cached prefixes. `lora_request`: the adapter they
        run with. `reasoning_end`: a reasoning model's end of thinking, after which their
        output constraint holds. `response_id`: the responses' id where it is not `request_id`,
        the engine's (`api_request_ids`)."""
        try:
            # NOTE: grammars compile on their own threads first, never holding tokenizing ones.
            for sp in params:
                await ctx.processor.prepare_grammar(sp, structured_param)
        except ValueError as e:
            raise invalid_input(e) from e

        def one(i: int, request_id: str, group: str) -> EngineRequest:
            return ctx.processor.process(request_id, prompts[i].token_ids, params[i],
                                         prompt_text=prompts[i].text, structured_param=structured_param,
                                         priority=priority, group=group, cache_salt=cache_salt,
                                         lora_request=lora_request, reasoning_end=reasoning_end)

        return await cls._start(ctx, request_id, prompts, one, params[0].n, user, response_id)

    @classmethod
    async def create_pooled(cls, ctx: ServerContext, request_id: str, prompts: list[Prompt],
                            params: PoolingParams, priority: int = 0,
                            user: str | None = None) -> Generation:
        """As `create`, for pooled requests (pooling.py): each prompt's vector comes in
        `pooled`, no choice gets a token."""

        def one(i: int, request_id: str, group: str) -> EngineRequest:
            return ctx.processor.process_pooling(request_id, prompts[i].token_ids, params,
                                                 prompt_text=prompts[i].text, priority=priority,
                                                 group=group)

        return await cls._start(ctx, request_id, prompts, one, 1, user)

    @classmethod
    async def _start(cls, ctx: ServerContext, request_id: str, prompts: list[Prompt],
                     process_one: Callable[[int, str, str], EngineRequest], n: int,
                     user: str | None, response_id: str | None = None) -> Generation:
        """Each prompt's engine request (`process_one(index, request id, group)`) validated in a
        worker thread (400s), then room in the queue for all their sequences (429)."""
        request_ids = ([request_id] if len(prompts) == 1
                       else [f"{request_id}-{i}" for i in range(len(prompts))])
        group = f"user:{user}" if user else request_id

        def process() -> list[EngineRequest]:
            return [process_one(i, rid, group) for i, rid in enumerate(request_ids)]

        try:
            requests = await asyncio.to_thread(process)
        except ValueError as e:
            raise invalid_input(e) from e
        admit(ctx, len(prompts) * n)
        if ctx.request_logger is not None:
            for req in requests:
                ctx.request_logger.log_inputs(req.request_id, req.prompt, req.prompt_token_ids,
                                              req.pooling_params or req.sampling_params, req.lora_request)
        return cls(ctx, request_id, prompts, requests, response_id)

    async def deltas(self, streaming: bool = True) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """Yields (choice index, delta) as the engine produces them (`streaming`: for a stream,
        as the request log names them)."""
        streams = [self.ctx.engine.generate_request(req) for req in self.requests]
        engine_ids = [req.request_id for req in self.requests]
        self.ctx.running.setdefault(self.response_id, []).extend(engine_ids)
        try:
            async for i, out in merge(streams):
                if out.error:
                    if out.error_is_request:
                        raise APIError(400, f"Generation stopped: {out.error}")
                    raise APIError(500, f"Generation failed: {out.error}")
                self.num_cached_tokens[i] = out.num_cached_tokens
                self.finished[i] = out.finished
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = out.prompt_logprobs
                if out.pooled is not None:
                    self.pooled[i] = out.pooled
                for delta in out.outputs:
                    index = i * self.n + delta.index
                    self.choices[index].add(delta)
                    if self.ctx.request_logger is not None:
                        self._log_output(self.requests[i].request_id, index, delta, streaming)
                    yield index, delta
        except APIError:
            raise
        except QueueFullError as e:
            raise queue_full(self.ctx, e) from e
        except ValueError as e:  # NOTE: e.g. a duplicate request id, raised before any output.
            raise invalid_input(e) from e
        except EngineDeadError as e:
            # NOTE: 503, as /health answers: this replica cannot serve; retry on another one.
            raise APIError(503, f"The engine is not running: {e}") from e
        except StreamCutError as e:
            # NOTE: a stream's error event then [DONE]: a cut answer must not pass for a whole one.
            raise APIError(503, f"The request was cut before it finished: {e}") from e
        except Exception as e:  # NOTE: a bug on this side; the client gets a 500.
            logger.exception("generation %s failed", self.request_id)
            raise APIError(500, f"{type(e).__name__}: {e}") from e
        finally:
            self._forget(engine_ids)
            self._abort_unfinished()

    def _forget(self, engine_ids: list[str]) -> None:
        running = self.ctx.running.get(self.response_id, [])
        for rid in engine_ids:
            running.remove(rid)
        if not running:
            self.ctx.running.pop(self.response_id, None)

    async def run(self) -> Generation:
        """Runs to completion, keeping only the final state of each choice."""
        async for _ in self.deltas(streaming=False):
            pass
        return self

    def _log_output(self, request_id: str, index: int, delta: CompletionOutput, streaming: bool) -> None:
        """A stream's delta, and a choice's whole answer when it ends, in the request log."""
        log = self.ctx.request_logger
        assert log is not None
        if streaming and (delta.text or delta.token_ids):
            log.log_output(request_id, delta.text, delta.token_ids, delta.finish_reason, True, delta=True)
        if delta.finish_reason is not None:
            choice = self.choices[index]
            log.log_output(request_id, choice.text, choice.token_ids, delta.finish_reason, streaming)

    def usage(self) -> UsageInfo:
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = sum(len(c.token_ids) for c in self.choices)
        details = PromptTokensDetails(cached_tokens=sum(self.num_cached_tokens))
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion, prompt_tokens_details=details)

    def _abort_unfinished(self) -> None:
        # NOTE: a fresh task, because this may run inside a cancelled scope where any await
        # would be cancelled again before the abort reached the engine.
        for req, done in zip(self.requests, self.finished, strict=True):
            if not done:
                task = asyncio.get_running_loop().create_task(
                    _abort_quietly(self.ctx.engine, req.request_id))
                _background_tasks.add(task)
                task.add_done_callback(_background_tasks.discard)


def stream_usage(ctx: ServerContext, req: SamplingFields) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk, and whether every chunk carries the usage so
    far: as stream_options ask, or both under --enable-force-include-usage (vLLM's rule)."""
    if ctx.force_include_usage:
        return True, True
    return req.include_usage, req.continuous_usage


@dataclass(frozen=True)
class TokenNames:
    """How a request's logprobs name tokens: by their text, or as "token_id:N" (vLLM's
    `--return-tokens-as-token-ids`, which a request's `return_tokens_as_token_ids` overrides:
    for tokens whose text alone is ambiguous)."""

    tokenizer: Any
    as_ids: bool = False

    @classmethod
    def of_request(cls, ctx: ServerContext, req: SamplingFields) -> TokenNames:
        asked = req.return_tokens_as_token_ids
        return cls(ctx.tokenizer, ctx.return_tokens_as_token_ids if asked is None else asked)

    def of_logprob(self, logprob: Logprob) -> str:
        return self.of_id(logprob.token_id, logprob.decoded_token)

    def of_id(self, token_id: int, decoded: str | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else str(self.tokenizer.decode([token_id]))


def prompt_logprobs_field(lps: PromptLogprobs | None) -> list[dict[int, PromptLogprob] | None] | None:
    """A response's `prompt_logprobs` in vLLM's shape, -inf clamped to -9999.0 as vLLM does."""
    if lps is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                              decoded_token=lp.decoded_token) for t, lp in entry.items()}
            for entry in lps]


def top_entries(entry: dict[int, Logprob], num: int) -> list[Logprob]:
    """The top-`num` candidates of one position, best first (every one the entry holds for -1:
    the whole vocabulary, or a request's `logprob_token_ids`)."""
    if num == WHOLE_VOCABULARY:
        return sorted(entry.values(), key=lambda lp: lp.rank)
    return sorted((lp for lp in entry.values() if lp.rank <= num), key=lambda lp: lp.rank)[:num]


def shown_logprobs(req: SamplingFields, num: int) -> int:
    """How many candidates a position's logprobs show: `num`, or all the entry holds (the
    sampled token and the request's `logprob_token_ids`) where the request names tokens."""
    return WHOLE_VOCABULARY if req.logprob_token_ids else num


# ---- beam search (vLLM's `use_beam_search`, pagoda/beam_search.py) ---------------------------

def beam_search_params(ctx: ServerContext, req: SamplingFields, prompts: list[Prompt],
                       max_tokens: int | None, length_penalty: float) -> BeamSearchParams:
    """The search a request asks for (`n` beams); 400s for what it cannot do."""
    if req.stream:
        raise bad_request("use_beam_search does not stream: send stream=false.", "stream")
    if req.prompt_logprobs is not None:
        raise bad_request("use_beam_search returns no prompt logprobs.", "prompt_logprobs")
    longest = max(len(p.token_ids) for p in prompts)
    error = context_length_error(ctx.max_model_len, longest, max_tokens)
    if error is not None:
        raise error
    defaults = ctx.generation_defaults
    # NOTE: as vLLM's to_beam_search_params, an omitted temperature is the generation config's.
    temperature = req.temperature if req.temperature is not None else defaults.params.get("temperature", 0.0)
    try:
        return BeamSearchParams(beam_width=req.n or 1,
                                max_tokens=defaults.max_tokens(max_tokens or None, ctx.max_model_len - longest),
                                ignore_eos=bool(req.ignore_eos), temperature=float(temperature),
                                length_penalty=length_penalty)
    except ValueError as e:
        raise invalid_input(e) from e


async def run_beam_search(ctx: ServerContext, raw: Any, request_id: str, prompts: list[Prompt],
                          params: BeamSearchParams, req: SamplingFields) -> list[BeamSearchOutput] | None:
    """Each step runs every live beam's next token as one request (`Generation`), so limits,
    fairness and disconnects apply as to any request; None if the client went away."""
    searches = [BeamSearch(p.token_ids, params, ctx.engine.eos_token_ids) for p in prompts]
    for step in range(params.max_tokens):
        if not (live := live_beams(searches)):
            break
        gen = await Generation.create(ctx, f"{request_id}-step{step}", [Prompt(b.tokens) for _, b in live],
                                      [params.step_params()] * len(live), priority=req.priority, user=req.user,
                                      cache_salt=req.cache_salt)
        if await until_disconnect(raw, gen.run()) is None:
            return None
        advance_all(searches, live, [(choice.logprobs or [{}])[0] for choice in gen.choices])
    return [search.result(ctx.tokenizer) for search in searches]


def beam_usage(prompts: list[Prompt], results: list[BeamSearchOutput]) -> UsageInfo:
    num_prompt = sum(len(p.token_ids) for p in prompts)
    num_completion = sum(len(beam.tokens) - len(prompt.token_ids)
                         for prompt, result in zip(prompts, results, strict=True) for beam in result.sequences)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion)
