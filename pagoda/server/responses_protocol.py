"""Pydantic models of OpenAI's Responses API (`/v1/responses`), as vLLM serves it.

The request takes OpenAI's fields pagoda can honour plus vLLM's sampling extensions; any
other field is refused by name, as on the other routes. `input` is a string or a list of
items: messages (text parts only), and earlier `function_call` / `function_call_output`
items; an item of another type is a 400 naming the types taken. The response object and its
output items carry the fields the official `openai` client reads.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from pagoda.server.protocol import OpenAIBaseModel, RequestModel, StructuredOutputsRequest, now

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
ToolChoiceMode = Literal["none", "auto", "required"]


def response_id(prefix: str) -> str:
    """OpenAI's ids of this API: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_or_list(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


def _item_type(value: Any) -> str:
    # NOTE: a message item may leave out its type (the openai client's `{"role", "content"}`).
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return str(kind)


# ---- request ------------------------------------------------------------------------------


class InputTextPart(OpenAIBaseModel):
    """A message's text: the user's (`input_text`) or an earlier answer's (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[Annotated[str, Tag("text")] | Annotated[list[InputTextPart], Tag("list")],
                       Discriminator(_text_or_list)]


class FunctionCallInput(OpenAIBaseModel):
    """A call the model made earlier (an earlier response's `function_call` item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(OpenAIBaseModel):
    """The client's result of a call, matched to it by `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningInput(OpenAIBaseModel):
    """An earlier response's reasoning item, sent back with the conversation: accepted, and
    left out of the prompt (chat templates drop earlier turns' thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: Status | None = None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item_type",
                  custom_error_message="an input item is of type 'message', 'function_call', "
                                       "'function_call_output' or 'reasoning' (pagoda takes no other)")]


class FunctionTool(OpenAIBaseModel):
    """A Responses-style function tool (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a text.format of type json_schema needs its `schema`")
        return self


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    """`POST /v1/responses`: OpenAI's fields, then vLLM's extensions."""

    model: str | None = None
    input: Annotated[Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("list")],
                     Discriminator(_text_or_list)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoiceMode | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    # NOTE: OpenAI's: answer at once ("queued"), generate apart; GET polls, POST .../cancel stops
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # NOTE: vLLM's extensions on this route.
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    priority: int = 0
    watermarking: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
                len(metadata) > MAX_METADATA_PAIRS
                or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                       for k, v in metadata.items())):
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                             f"{MAX_METADATA_KEY} characters, values of at most "
                             f"{MAX_METADATA_VALUE}")
        return metadata


# ---- response -----------------------------------------------------------------------------


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: response_id("msg"))
    status: Status = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: response_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "completed"


class ReasoningItem(OpenAIBaseModel):
    """The thinking a `--reasoning-parser` took out of the answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: response_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Status = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(OpenAIBaseModel):
    """The response object: what was generated, and the request's settings as applied."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Status
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    # NOTE: the request's own settings echoed as JSON (`schema` under its name, unset keys out).
    text: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool
