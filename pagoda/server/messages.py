"""Anthropic's Messages API on the chat path, as vLLM 0.32 serves it: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, so that Anthropic's SDK and the tools built on it reach a
local model.

A Messages request becomes a chat completion request (`chat_request_of`: the system prompt
first; text, thinking, tool_use and tool_result blocks as chat content, reasoning, tool calls and
tool messages; tools with their `input_schema`; `tool_choice` auto/any/tool/none as
auto/required/named/none; `thinking` enabled as a `thinking_token_budget`, disabled as reasoning
effort "none"; `output_config.format` as a JSON schema) and runs as one. Its answer comes back
as Anthropic's message (thinking, text and tool_use blocks; `stop_reason` end_turn,
max_tokens, stop_sequence or tool_use by vLLM's rule; usage with the prompt tokens read from
and written to the prefix cache apart)
or as Anthropic's stream events. Errors have Anthropic's shape (`{"type": "error", "error":
{...}}`), the type named as vLLM names it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.config import CacheConfig
from pagoda.server.chat import chat_inputs, full_chat, render_chat, start_chat, stream_chat
from pagoda.server.errors import APIError, bad_request, error_body, invalid_fields
from pagoda.server.messages_protocol import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
)
from pagoda.server.protocol import ChatCompletionRequest, ChatMessage, UsageInfo
from pagoda.server.serving import RequestIds, ServerContext, TokenNames, check_lora_model
from pagoda.server.streaming import until_disconnect


def chat_request_of(req: AnthropicCountTokensRequest, merge_inline_system: bool = False) -> ChatCompletionRequest:
    """The chat completion request that runs `req` (vLLM's `to_chat_completion_request`);
    `merge_inline_system`: system messages in mid-conversation join the first one
    (`inline_system_merged`)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req, merge_inline_system)}
    if req.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if isinstance(req, AnthropicMessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, cache_salt=req.cache_salt, watermarking=req.watermarking,
                    stream=req.stream)
        if req.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    config = req.output_config
    if config is not None and config.format is not None and config.format.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "json_schema", "schema": config.format.json_schema}}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    if req.thinking is not None and req.thinking.type == "disabled":
        body["reasoning_effort"] = "none"
    elif req.thinking is not None and req.thinking.type == "enabled":
        body["thinking_token_budget"] = req.thinking.budget_tokens
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}}
            for t in req.tools]
        body.setdefault("tool_choice", "auto")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise invalid_fields(e.errors()) from e


def _messages(req: AnthropicCountTokensRequest, merge_inline_system: bool) -> list[dict[str, Any]]:
    system = _text_of(req.system) if req.system is not None else ""
    if merge_inline_system:
        system += "".join(_text_of(m.content) for m in req.messages if m.role == "system")
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for message in req.messages:
        if message.role == "system":
            if not merge_inline_system and (text := _text_of(message.content)):
                out.append({"role": "system", "content": text})
        elif isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        else:
            out += _blocks(message.role, message.content)
    return out


def _text_of(content: str | list[AnthropicContentBlock]) -> str:
    """A system prompt's text (its billing header blocks left out, as vLLM's)."""
    if isinstance(content, str):
        return "" if content.startswith("x-anthropic-billing-header") else content
    return "".join(b.text for b in content if b.type == "text" and b.text
                   and not b.text.startswith("x-anthropic-billing-header"))


def _blocks(role: str, blocks: list[AnthropicContentBlock]) -> list[dict[str, Any]]:
    """One message's blocks as chat messages: its own (text, reasoning, tool calls) after the
    tool messages its tool_result blocks make."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        elif block.type == "tool_use":
            calls.append({"id": block.id or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": _result_text(block.content)})
        elif block.type == "tool_result":
            texts.append(f"Tool result: {_result_text(block.content)}")
        elif block.type not in ("redacted_thinking", "tool_reference"):
            raise bad_request(f"Content blocks of type {block.type!r} are not supported: pagoda serves "
                              "text-only models.", "messages")
    message: dict[str, Any] = {"role": role}
    if texts:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    own = [message] if len(message) > 1 or role == "assistant" else []
    return results + own


def _result_text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "\n".join(str(item.get("text", "")) for item in content if item.get("type") == "text")
    return content or ""


# ---- routes -------------------------------------------------------------------------------


PROBE = [ChatMessage(role="user", content="a"), ChatMessage(role="system", content="b"),
         ChatMessage(role="user", content="c")]


async def inline_system_merged(ctx: ServerContext) -> bool:
    """vLLM's probe, once a server: whether the chat template refuses a system message in
    mid-conversation (Llama 2's and Mistral's raise), so that such messages are merged into the
    first one instead of failing every request that has them."""
    if ctx.merge_inline_system is None:
        try:
            await render_chat(ctx, PROBE, True)
            ctx.merge_inline_system = False
        except APIError:
            ctx.merge_inline_system = True
    return ctx.merge_inline_system


def anthropic_error(e: APIError) -> JSONResponse:
    """`e` in Anthropic's shape, its type as vLLM names it."""
    body = error_body(e.status, e.message, e.param, e.code, e.error_type)["error"]
    return JSONResponse({"type": "error", "error": {"type": body["type"], "message": body["message"]}},
                        status_code=e.status, headers=e.headers)


async def _parse(raw: Request, model: type[AnthropicCountTokensRequest]) -> Any:
    try:
        return model.model_validate(await raw.json())
    except ValidationError as e:
        raise invalid_fields(e.errors()) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The body is not JSON: {e}") from e


async def create_messages(ctx: ServerContext, raw: Request) -> Response:
    """`POST /v1/messages`."""
    try:
        req = await _parse(raw, AnthropicMessagesRequest)
        check_lora_model(ctx, req.model, False)
        chat = chat_request_of(req, await inline_system_merged(ctx))
        inputs = await chat_inputs(ctx, chat)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        gen = await start_chat(ctx, chat, inputs, RequestIds(message_id, message_id))
    except APIError as e:
        return anthropic_error(e)
    if req.stream:
        return StreamingResponse(_events(stream_chat(gen, chat, req.model, None, inputs), message_id, req.model,
                                         ctx.engine.config.cache), media_type="text/event-stream")
    try:
        if await until_disconnect(raw, gen.run()) is None:
            return Response(status_code=499)
    except APIError as e:
        return anthropic_error(e)
    answer = full_chat(gen, req.model, None, inputs, TokenNames(ctx.tokenizer))
    choice = answer.choices[0]
    calls = choice.message.tool_calls
    blocks: list[dict[str, Any]] = []
    if choice.message.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": uuid.uuid4().hex})
    if choice.message.content:
        blocks.append({"type": "text", "text": choice.message.content})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.function.name,
                "input": json.loads(call.function.arguments)} for call in calls]
    stop_reason, stop_sequence = stop_reason_of(choice.finish_reason, choice.stop_reason, bool(calls), bool(calls))
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant",
                         "content": blocks or [{"type": "text", "text": ""}], "model": req.model,
                         "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": usage_of(answer.usage, ctx.engine.config.cache)})


async def count_tokens(ctx: ServerContext, raw: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the rendered prompt's tokens."""
    try:
        req = await _parse(raw, AnthropicCountTokensRequest)
        ctx.lora_for(req.model)
        inputs = await chat_inputs(ctx, chat_request_of(req, await inline_system_merged(ctx)))
    except APIError as e:
        return anthropic_error(e)
    return JSONResponse({"input_tokens": len(inputs.prompt.token_ids)})


def stop_reason_of(finish_reason: str | None, stop_reason: int | str | None, tool_used: bool,
                   tool_complete: bool) -> tuple[str | None, str | None]:
    """vLLM's mapping to Anthropic's (stop_reason, stop_sequence): max_tokens first; tool_use
    for complete calls; a matched stop string; tool_use for any call; else end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("tool_use" if finish_reason == "tool_calls" or tool_used else "end_turn"), None


def usage_of(usage: UsageInfo | dict[str, Any] | None, cache: CacheConfig) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens read from the prefix cache, those written to it
    (vLLM's count: the prompt's whole blocks, cached now, less those read), and the rest."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    info = usage if isinstance(usage, UsageInfo) else UsageInfo.model_validate(usage)
    read = info.prompt_tokens_details.cached_tokens if info.prompt_tokens_details else 0
    whole_blocks = info.prompt_tokens // cache.block_size * cache.block_size
    created = max(0, whole_blocks - read) if cache.enable_prefix_caching else 0
    return {"input_tokens": max(0, info.prompt_tokens - read - created), "output_tokens": info.completion_tokens,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read}


# ---- streaming ----------------------------------------------------------------------------


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a streamed message, and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.tool_id: str | None = None

    def start(self, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.kind, self.tool_id = block["type"], block.get("id")
        return [*events, _event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":  # NOTE: vLLM's: a thinking block closes with a signature
            events.append(self.delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        events.append(_event({"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return events


async def _events(chunks: AsyncIterator[str], message_id: str, model: str,
                  cache: CacheConfig) -> AsyncIterator[str]:
    """The chat stream's chunks as Anthropic's events: message_start, each block's start, deltas
    and stop, message_delta (stop reason, usage), message_stop; a failure as an error event."""
    blocks, started = _Blocks(), False
    finish: str | None = None
    stop: int | str | None = None
    tool_args: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async for text in chunks:
            chunk = json.loads(text)
            usage = chunk.get("usage") or usage
            if not started:
                started = True
                yield _event({"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
                    "stop_reason": None, "stop_sequence": None,
                    # NOTE: vLLM's: the whole prompt here, split by the cache in message_delta
                    "usage": {"input_tokens": (usage or {}).get("prompt_tokens", 0), "output_tokens": 0}}})
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is not None:
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
            delta = choice["delta"]
            for event in _delta_events(blocks, delta, tool_args):
                yield event
    except APIError as e:
        yield _event({"type": "error", "error": {"type": "internal_error" if e.status >= 500 else "invalid_request_error",
                                                 "message": e.message}})
        return
    events = blocks.stop() if blocks.index >= 0 else [*blocks.start({"type": "text", "text": ""}), *blocks.stop()]
    for event in events:
        yield event
    used = bool(tool_args)
    stop_reason, stop_sequence = stop_reason_of(finish or "stop", stop, used, used and _is_json("".join(tool_args)))
    yield _event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                  "usage": usage_of(usage, cache)})
    yield _event({"type": "message_stop"})


def _delta_events(blocks: _Blocks, delta: dict[str, Any], tool_args: list[str]) -> list[str]:
    events: list[str] = []
    if delta.get("reasoning"):
        if blocks.kind != "thinking":
            events += blocks.start({"type": "thinking", "thinking": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
    if delta.get("content"):
        if blocks.kind != "text":
            events += blocks.start({"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": delta["content"]}))
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        if call.get("id") is not None and call["id"] != blocks.tool_id:
            tool_args.clear()
            events += blocks.start({"type": "tool_use", "id": call["id"], "name": function.get("name", ""),
                                    "input": {}})
        if function.get("arguments") and blocks.kind == "tool_use":
            tool_args.append(function["arguments"])
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
    return events


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
