"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat path.

A Responses request becomes a chat completion request (`chat_request`): `instructions` a
system message first, then the conversation `previous_response_id` ended, then `input`'s
items as chat messages (a `function_call` joins the assistant message before it as a tool
call, a `function_call_output` is a `tool` message); `text.format` is `response_format`,
`max_output_tokens` is `max_completion_tokens`. The chat machinery (template, tools, output
constraint, sampling, validation, queue) runs it, and its output comes back as output items:
its reasoning (with a `--reasoning-parser`, a `reasoning` item, left out of a later turn's
prompt), a message with the text, then one `function_call` per tool call. A 400 names the Responses
field (`input`, `max_output_tokens`, `text.format`), not the chat one it went through.
Streamed, the events are OpenAI's (`response_events.py`). With `store` (the default) the
finished response and its conversation are kept (`response_store.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.server.chat import chat_inputs, start_chat
from pagoda.server.constraints import check_supported
from pagoda.server.errors import APIError, bad_request
from pagoda.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    JSONSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    UsageInfo,
)
from pagoda.server.reasoning import ReasoningStream
from pagoda.server.response_events import OutputEvents, output_items
from pagoda.server.response_store import StoredResponse
from pagoda.server.responses_protocol import (
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutputInput,
    IncompleteDetails,
    InputItem,
    InputMessage,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    ReasoningItem,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    Status,
    TextFormat,
    ToolChoiceFunction,
    ToolChoiceMode,
    response_id,
)
from pagoda.server.serving import Generation, RequestIds, ServerContext
from pagoda.server.streaming import sse_events, until_disconnect
from pagoda.server.tools import ToolPlan, ToolStream

# NOTE: the chat field an error names -> the Responses field the client wrote.
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
VLLM_EXTRAS = ("top_k", "seed", "stop", "repetition_penalty", "ignore_eos", "skip_special_tokens",
               "include_stop_str_in_output", "logit_bias", "structured_outputs", "priority",
               "watermarking")

logger = logging.getLogger(__name__)


def not_found(response_id: str, param: str) -> APIError:
    """vLLM's words, in OpenAI's shape (`invalid_request_error`)."""
    return APIError(404, f"Response with id '{response_id}' not found.", param,
                    error_type="invalid_request_error")


def retrieve_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    entry = ctx.response_store.get(response_id)
    if entry is None:
        raise not_found(response_id, "response_id")
    return entry.response


def chat_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` (or output items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else [
                {"type": "text", "text": part.text} for part in item.content]
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _as_input(item: OutputMessage | FunctionCallItem) -> InputItem:
    if isinstance(item, FunctionCallItem):
        return FunctionCallInput(type="function_call", call_id=item.call_id, name=item.name,
                                 arguments=item.arguments)
    return InputMessage(role="assistant", content="".join(part.text for part in item.content))


def previous_messages(ctx: ServerContext, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    entry = ctx.response_store.get(previous_id)
    if entry is None:
        raise not_found(previous_id, "previous_response_id")
    return entry.messages


def _response_format(fmt: TextFormat | None) -> ResponseFormat | None:
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat.model_validate(
        {"name": fmt.name or "response", "description": fmt.description,
         "schema": fmt.json_schema, "strict": fmt.strict}))


def _tool_choice(req: ResponsesRequest) -> ToolChoiceMode | NamedToolChoice | None:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return NamedToolChoice(function=FunctionName(name=choice.name))
    # NOTE: "auto" is OpenAI's default: without tools it asks for nothing.
    return None if choice == "auto" and not req.tools else choice


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that answers `req`, `messages` its conversation."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise bad_request("`input` holds no item to answer.", "input")
    tools = [ChatCompletionTool(function=FunctionDefinition(**t.model_dump(exclude={"type"})))
             for t in req.tools]
    return ChatCompletionRequest(
        messages=[ChatMessage(**m) for m in messages], model=req.model,
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, stream=req.stream, user=req.user, tools=tools or None,
        tool_choice=_tool_choice(req), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text.format if req.text else None),
        **{name: getattr(req, name) for name in VLLM_EXTRAS})


@contextmanager
def responses_params() -> Iterator[None]:
    """Renames the chat field a 400 names to the Responses field it came from."""
    try:
        yield
    except APIError as e:
        e.param = CHAT_PARAMS.get(e.param or "", e.param)
        raise


def response_usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached))


def _echoed_text(req: ResponsesRequest) -> dict[str, Any]:
    if req.text is None or req.text.format is None:
        return {"format": {"type": "text"}}
    return req.text.model_dump(by_alias=True, exclude_none=True)


def _echoed_tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    return choice.model_dump() if isinstance(choice, ToolChoiceFunction) else choice or "auto"


@dataclass
class ResponseTurn:
    """One request's generation, and the conversation up to its output (without the
    instructions): what the response object is built from, and what is stored."""

    ctx: ServerContext
    req: ResponsesRequest
    gen: Generation
    plan: ToolPlan
    messages: list[dict[str, Any]]

    @property
    def status(self) -> Status:
        return "incomplete" if self.gen.choices[0].finish_reason == "length" else "completed"

    def response(self, status: Status, output: list[OutputItem] | None = None,
                 usage: ResponseUsage | None = None) -> ResponsesResponse:
        """The response object; settings are those applied (vLLM's), the request's otherwise."""
        req, params = self.req, self.gen.requests[0].sampling_params
        return ResponsesResponse(
            id=self.gen.response_id, created_at=self.gen.created, status=status,
            model=req.model or self.ctx.model_name, output=output or [], usage=usage,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=req.instructions, previous_response_id=req.previous_response_id,
            text=_echoed_text(req), tools=[t.model_dump(exclude_none=True) for t in req.tools],
            tool_choice=_echoed_tool_choice(req), parallel_tool_calls=req.parallel_tool_calls,
            temperature=params.temperature, top_p=params.top_p,
            max_output_tokens=params.max_tokens, metadata=req.metadata, user=req.user,
            store=req.store)

    def finish(self, output: list[OutputItem]) -> ResponsesResponse:
        """The finished response, stored with its conversation when the request asks."""
        response = self.response(self.status, output, response_usage(self.gen.usage()))
        if self.req.store:
            conversation = self.messages + chat_messages(
                [_as_input(item) for item in output if not isinstance(item, ReasoningItem)])
            self.ctx.response_store.put(response.id, StoredResponse(
                response.model_dump(mode="json"), conversation))
        return response


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request) -> Response:
    ctx.lora_for(req.model)  # NOTE: a LoRA adapter's name is a model here too (start_chat takes it)
    check_supported(req)
    if req.background and not req.store:
        raise bad_request("background can only be used when `store` is true", "background")  # NOTE: vLLM's words
    if req.background and ctx.response_store.max_size == 0:
        raise APIError(400, "Background mode needs the responses store: this server runs with "
                            "--responses-store-size 0.", "background", error_type="invalid_request_error")
    if req.background and req.stream:
        raise APIError(400, "Background mode is not supported with stream=true here; poll GET "
                            "/v1/responses/{id} instead.", "background", error_type="invalid_request_error")
    messages = previous_messages(ctx, req.previous_response_id) + chat_messages(req.input)
    with responses_params():
        chat = chat_request(req, messages)
        inputs = await chat_inputs(ctx, chat)
        rid = response_id("resp")
        gen = await start_chat(ctx, chat, inputs, RequestIds(rid, rid))
    turn = ResponseTurn(ctx, req, gen, inputs.plan, messages)
    if req.background:
        return JSONResponse(start_background(turn).model_dump(mode="json"))
    if req.stream:
        return StreamingResponse(sse_events(stream_response(turn)),
                                 media_type="text/event-stream")
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    output = output_items(inputs.plan, gen.choices[0].text, turn.status, ctx.reasoning_parser)
    return JSONResponse(turn.finish(output).model_dump(mode="json"))


def start_background(turn: ResponseTurn) -> ResponsesResponse:
    """OpenAI's background mode: the response stored "queued" and answered at once, generated by a
    task of the server's own ("in_progress" once it runs) that stores it finished (or "failed");
    `cancel_response` stops it."""
    queued = turn.response("queued")
    ctx, response_id = turn.ctx, queued.id
    ctx.response_store.put(response_id, StoredResponse(queued.model_dump(mode="json"), turn.messages))
    task = asyncio.get_running_loop().create_task(_run_background(turn), name=f"background {response_id}")
    ctx.background[response_id] = task
    task.add_done_callback(lambda _: ctx.background.pop(response_id, None))
    return queued


async def _run_background(turn: ResponseTurn) -> None:
    entry = turn.ctx.response_store.get(turn.gen.response_id)
    if entry is not None and entry.response["status"] == "queued":
        entry.response["status"] = "in_progress"  # NOTE: OpenAI's: its generation has begun
    try:
        await turn.gen.run()
    except APIError as e:
        logger.warning("background response %s failed: %s", turn.gen.response_id, e.message)
        failed = turn.response("failed").model_dump(mode="json")
        failed["error"] = {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message}
        turn.ctx.response_store.put(turn.gen.response_id, StoredResponse(failed, turn.messages))
        return
    turn.finish(output_items(turn.plan, turn.gen.choices[0].text, turn.status, turn.ctx.reasoning_parser))


async def cancel_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    """OpenAI's `POST /v1/responses/{id}/cancel` (vLLM's rules): a background response still
    queued is stopped and stored "cancelled"; any other is a 400."""
    entry = ctx.response_store.get(response_id)
    if entry is None:
        raise not_found(response_id, "response_id")
    if entry.response["status"] not in ("queued", "in_progress"):
        raise APIError(400, "Cannot cancel a synchronous response.", "response_id",
                       error_type="invalid_request_error")
    entry.response["status"] = "cancelled"
    task = ctx.background.get(response_id)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return entry.response


async def stream_response(turn: ResponseTurn) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's events: created, in progress, each output item's (added, deltas, done), then
    completed (the status says whether `max_output_tokens` cut it, as vLLM's stream does)."""
    snapshot = turn.response("in_progress").model_dump(mode="json")
    yield {"type": "response.created", "response": snapshot}
    yield {"type": "response.in_progress", "response": snapshot}
    tools, output = ToolStream(turn.plan), OutputEvents()
    parser = turn.ctx.reasoning_parser
    thinking = ReasoningStream(parser) if parser is not None else None
    async for _, delta in turn.gen.deltas():
        last, text = delta.finish_reason is not None, delta.text
        if thinking is not None:
            thought, text = thinking.step(text, last)
            for event in output.feed_reasoning(thought):
                yield event
        messages, _ = tools.step(text, last)
        for message in messages:
            for event in output.feed(message):
                yield event
    for event in output.close(turn.status):
        yield event
    yield {"type": "response.completed", "response": turn.finish(output.items).model_dump(mode="json")}
