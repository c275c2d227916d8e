"""Pydantic models of the OpenAI HTTP schema, as vLLM extends it.

Requests accept vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, ...) and ignore unknown fields, as OpenAI's own server does. Responses carry
exactly the fields the official `openai` client reads, plus vLLM's `stop_reason`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from pagoda.sampling_params import INT64_MAX, INT64_MIN


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string in `value` (nested dicts and lists, keys too) is not valid Unicode.

    NOTE: a walk with an explicit stack, not recursion: a body nested 10,000 deep (a JSON
    schema, a message) must be a clear answer, not a RecursionError."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class RequestModel(OpenAIBaseModel):
    """A request body: its strings must be valid Unicode (JSON allows a lone surrogate escape,
    which no tokenizer, template or UTF-8 response can carry). Unknown fields are kept in
    `model_extra` so that the route refuses them by name (nothing is silently ignored)."""

    model_config = ConfigDict(extra="allow")

    def unsupported_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_lone_surrogate(data):
            raise ValueError("the body holds a string that is not valid Unicode "
                             "(a lone surrogate)")
        return data


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors -------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared request pieces ----------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    model_config = ConfigDict(extra="forbid")


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` field (one constraint)."""

    json_spec: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RepetitionDetection(OpenAIBaseModel):
    """vLLM's `repetition_detection` (sampling_params.RepetitionDetectionParams)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    model_config = ConfigDict(extra="forbid")


class SamplingFields(RequestModel):
    """The sampling fields completions and chat share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # NOTE: bounded here, as vLLM's protocol bounds it, so the 400 is pydantic's
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # NOTE: vLLM's (SamplingParams' field)
    stream: bool = False
    # NOTE: vLLM's: a stream's chunks carry at least this many tokens (the server's
    # --stream-interval is the floor); nothing changes for a whole answer
    stream_interval: int | None = Field(default=None, ge=1)
    # NOTE: vLLM's: a reasoning model's thinking capped at N tokens, then its end forced
    # (needs --reasoning-parser or --reasoning-config; -1: no cap)
    thinking_token_budget: int | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # NOTE: vLLM's (SamplingParams.bad_words)
    # NOTE: vLLM's: {"max_pattern_size", "min_pattern_size", "min_count"}, checked by SamplingParams
    repetition_detection: RepetitionDetection | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # NOTE: vLLM's beam search: `n` beams, best first (pagoda/beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    # NOTE: vLLM's: with logprobs, these tokens' log-probabilities in place of the top N
    logprob_token_ids: list[int] | None = None
    # NOTE: vLLM's: the render routes' per-token (start, end) character offsets; ignored elsewhere
    return_token_offsets: bool | None = False
    return_token_ids: bool | None = None
    # NOTE: vLLM's: logprobs name tokens "token_id:N"; None: as --return-tokens-as-token-ids says
    return_tokens_as_token_ids: bool | None = None
    # NOTE: vLLM's: salts the prefix cache's block hashes, so that requests without the same
    # salt never share (or time) each other's cached prefixes.
    cache_salt: str | None = Field(default=None, min_length=1)
    # NOTE: vLLM's: whether the server's watermark (--watermark-config) applies; None: it does
    watermarking: bool | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields that map one to one onto `SamplingParams`, without unset ones."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "stream_interval", "thinking_token_budget",
                 "allowed_token_ids", "bad_words", "prompt_logprobs", "logprob_token_ids", "watermarking")
        values = {name: getattr(self, name) for name in names}
        if self.repetition_detection is not None:
            values["repetition_detection"] = self.repetition_detection.model_dump()
        return {name: value for name, value in values.items() if value is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's extension: usage so far in every chunk (needs include_usage)."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


# ---- /v1/completions ----------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # NOTE: 16 is OpenAI's and vLLM's default for the legacy completions API.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    request_id: str | None = None  # NOTE: vLLM's: the response's id after its prefix (`api_request_ids`)
    add_special_tokens: bool = True  # NOTE: vLLM's: the tokenizer's BOS (etc.) before a text prompt


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's `Logprob` as its responses' `prompt_logprobs` carry it (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# NOTE: vLLM's shape: None for the first prompt token, then token id -> PromptLogprob.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


_UNASKED = ("prompt_logprobs", "token_ids", "prompt_token_ids", "prompt_text")


def _drop_unasked_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Leaves vLLM's `token_ids` and `prompt_token_ids` out of a stream's chunks unless asked
    for, as vLLM's chunks leave unset fields out. (A whole response carries them, and
    `prompt_logprobs`, as null, as vLLM's does: clients read them as attributes.)"""
    for name in _UNASKED:
        if name in data and data[name] is None:
            del data[name]
    return data


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamChoice(CompletionResponseChoice):
    """A streamed choice (vLLM's CompletionResponseStreamChoice): vLLM's own fields present
    only when asked for, as vLLM's chunks leave unset fields out."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_unasked_fields(handler(self))


class CompletionStreamResponse(CompletionResponse):
    """One chunk of a streamed completion (server/chunks.py writes it without pydantic)."""

    choices: list[CompletionStreamChoice]  # type: ignore[assignment]


# ---- /v1/chat/completions -----------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    """A request message; `content` may be a string or a list of typed parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid")


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    model_config = ConfigDict(extra="forbid")


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # NOTE: vLLM's: the answer continues the last message (its end of turn left out), and with
    # `echo` starts with that message's text where it is the answer's role
    continue_final_message: bool = False
    echo: bool = False
    # NOTE: vLLM's disaggregated serving: a router forwards the prefill stage's prompt ids here
    # (`prompt_token_ids`), which the answer then continues as they are; pagoda moves no KV
    # between instances (--kv-transfer-config is refused), so its other keys mean nothing here
    kv_transfer_params: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # NOTE: refused unless --trust-request-chat-template
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # NOTE: vLLM's: False drops the reasoning (--reasoning-parser)
    request_id: str | None = None  # NOTE: vLLM's: the response's id after its prefix (`api_request_ids`)
    # NOTE: vLLM's: the tokenizer's special tokens added to the rendered template (which has its own)
    add_special_tokens: bool = False
    # NOTE: vLLM's: both go to the chat template (`chat.template_kwargs`); a reasoning effort
    # other than "none" also sets `enable_thinking` unless chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    documents: list[dict[str, str]] | None = None
    # NOTE: vLLM's: the response carries the rendered prompt (`prompt_text`; a stream's first chunk)
    return_prompt_text: bool | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # NOTE: with --reasoning-parser, the thinking; vLLM sends it under both names.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `tool_calls` member where the answer called none, as OpenAI and vLLM send it."""
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsField = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None  # NOTE: vLLM's, with `return_prompt_text`


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(OpenAIBaseModel):
    """A streamed message delta; unset fields are left out, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_unasked_fields(handler(self))


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_unasked_fields(handler(self))


# ---- /v1/models, /tokenize, /detokenize ---------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    """vLLM's two shapes in one: `prompt` (completion) or `messages` (chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
