"""Pydantic models of Anthropic's Messages API as vLLM 0.32 serves it (`/v1/messages`,
`/v1/messages/count_tokens`): the request, its content blocks, tools and settings.

Content blocks keep their fields loose (`AnthropicContentBlock`), as vLLM's do: `messages.py`
reads the kinds it serves (text, thinking, tool_use, tool_result) and refuses the others by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.server.protocol import RequestModel


class AnthropicContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicContentBlock]


class AnthropicTool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)
    display: str | None = None


class AnthropicOutputFormat(BaseModel):
    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class AnthropicOutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: AnthropicOutputFormat | None = None


class AnthropicCountTokensRequest(RequestModel):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[AnthropicContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # NOTE: vLLM's


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # NOTE: vLLM's
    watermarking: bool | None = None  # NOTE: vLLM's
