"""POST /v1/chat/completions: messages rendered by the chat template, an assistant reply out."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.outputs import Logprob
from pagoda.server.chunks import (
    NULL,
    ChunkEncoder,
    chat_choice,
    content_delta,
    ids_members,
    part_json,
    reasoning_delta,
    role_delta,
)
from pagoda.server.errors import bad_request
from pagoda.server.protocol import (
    AssistantMessage,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
)
from pagoda.server.reasoning import END, ReasoningStream, split
from pagoda.server.serving import (
    ChoiceState,
    Generation,
    Prompt,
    RequestIds,
    ServerContext,
    TokenNames,
    api_request_ids,
    beam_search_params,
    beam_usage,
    build_sampling_params,
    check_lora_model,
    invalid_input,
    prompt_logprobs_field,
    request_fields,
    run_beam_search,
    shown_logprobs,
    stream_usage,
    tokenize_text,
    top_entries,
    truncate_prompt,
)
from pagoda.server.streaming import sse, until_disconnect
from pagoda.server.tools import ToolPlan, ToolStream, parse_calls, plan_tools

UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not "
                      "set. Refused request with untrusted chat template.")
# NOTE: a template that loops over a message's content (`for part in message['content']`)
# takes OpenAI's list of parts; vLLM's "auto" looks for the same in the template's syntax tree.
_ITERATES_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+[^%}\n]*?(\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_format(setting: str, source: str) -> str:
    """"string" (text parts joined by newlines) or "openai" (the list of text parts) for a
    template's `message['content']`: `setting` (--chat-template-content-format), or for
    "auto" what the template's source does with it."""
    if setting != "auto":
        return setting
    return "openai" if _ITERATES_CONTENT.search(source) else "string"


def _message_dict(message: ChatMessage, fmt: str) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        if any(part.get("type") != "text" for part in content):
            raise bad_request("Only text content parts are supported.", "messages")
        texts = [str(part.get("text", "")) for part in content]
        data["content"] = [{"type": "text", "text": t} for t in texts] if fmt == "openai" else "\n".join(texts)
    else:
        data["content"] = [{"type": "text", "text": content or ""}] if fmt == "openai" else content or ""
    return data


def _num_chars(message: dict[str, Any]) -> int:
    content = message["content"]
    return len(content) if isinstance(content, str) else sum(len(part["text"]) for part in content)


def chat_template_for(ctx: ServerContext, req: ChatCompletionRequest) -> str | None:
    """The template `req` renders with: its own `chat_template` (or one in its
    `chat_template_kwargs`), only under --trust-request-chat-template as vLLM, else the
    server's (None: the tokenizer's)."""
    own = req.chat_template if req.chat_template is not None else (req.chat_template_kwargs or {}).get("chat_template")
    if own is None:
        return ctx.chat_template
    if not ctx.trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, "chat_template")
    return str(own)


def _template_source(ctx: ServerContext, template: str | None) -> str:
    return str(template or getattr(ctx.tokenizer, "chat_template", None) or "")


def template_has_tools(ctx: ServerContext, template: str | None = None) -> bool:
    """Whether the chat template renders `tools` (it then has a tool-call format)."""
    return "tools" in _template_source(ctx, template or ctx.chat_template)


async def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                      template_kwargs: dict[str, Any] | None = None,
                      tools: ToolPlan | None = None, template: str | None = None,
                      continue_final_message: bool = False) -> str:
    """Applies the chat template (--chat-template, else the tokenizer's), in a worker thread.

    The messages' text is size-checked first (`--max-prompt-chars`), so a huge conversation
    is refused before any templating or tokenizing. `template_kwargs` (the request's) go over
    the server's `--default-chat-template-kwargs`. Tools go to a template that renders them;
    for one that cannot, a call's tools are described in a system message.
    `continue_final_message` (vLLM's): the last message is left open for the model to continue.
    """
    if continue_final_message and add_generation_prompt:
        # NOTE: vLLM's words
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    template = template or ctx.chat_template
    fmt = content_format(ctx.chat_template_content_format, _template_source(ctx, template))
    conversation = [_message_dict(m, fmt) for m in messages]
    template_kwargs = {k: v for k, v in {**ctx.default_chat_template_kwargs, **(template_kwargs or {})}.items()
                       if k != "chat_template"}
    if tools is not None and tools.tools:
        if template_has_tools(ctx, template):
            template_kwargs["tools"] = tools.template_tools()
        elif tools.calls_tools:
            conversation = _with_system_note(conversation, tools.system_note())
    num_chars = sum(_num_chars(m) for m in conversation)
    try:
        ctx.processor.check_num_chars(num_chars, "messages")
    except ValueError as e:
        raise invalid_input(e) from e
    if continue_final_message:
        template_kwargs["continue_final_message"] = True
    return await asyncio.to_thread(_apply_template, ctx, template, conversation, add_generation_prompt,
                                   template_kwargs)


def _with_system_note(conversation: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    if conversation and conversation[0].get("role") == "system":
        first = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{note}"}
        return [first, *conversation[1:]]
    return [{"role": "system", "content": note}, *conversation]


def _apply_template(ctx: ServerContext, template: str | None, conversation: list[dict[str, Any]],
                    add_generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> str:
    try:
        text = ctx.tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as e:  # NOTE: jinja raises its own errors for conversations it rejects.
        raise bad_request(f"The chat template could not be applied: {e}", "messages") from e
    return str(text)


def chat_logprobs(names: TokenNames, token_ids: list[int], entries: list[dict[int, Logprob]],
                  num: int) -> ChatCompletionLogProbs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        token = names.of_logprob(sampled) if sampled else names.of_id(token_id)
        tops = [ChatLogProb(token=(t := names.of_logprob(lp)), logprob=lp.logprob,
                            bytes=list(t.encode()))
                for lp in top_entries(entry, num)]
        content.append(ChatLogProbsContent(
            token=token, logprob=sampled.logprob if sampled else float("-inf"),
            bytes=list(token.encode()), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


def num_logprobs_of(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.",
                          "top_logprobs")
    if req.logprob_token_ids and not req.logprobs:
        raise bad_request("when using `logprob_token_ids`, `logprobs` must be set to true.",
                          "logprob_token_ids")
    return (req.top_logprobs or 0) if req.logprobs else None


@dataclass
class ChatInputs:
    """A chat request's checked inputs: its tool plan, its `SamplingParams` keywords (the
    tools' constraint included), the field a grammar error names, the prompt, max tokens, and
    the answer's role (vLLM's: `--response-role` after a generation prompt, else the last
    message's role, the model continuing it)."""

    plan: ToolPlan
    fields: dict[str, Any]
    structured_param: str
    prompt: Prompt
    max_tokens: int | None
    role: str = "assistant"
    echo: str = ""  # NOTE: vLLM's chat `echo`: the last message's text, which the answer starts with


async def chat_inputs(ctx: ServerContext, req: ChatCompletionRequest) -> ChatInputs:
    """Checks the fields and tools, renders and tokenizes the conversation (400s)."""
    fields, structured_param = request_fields(req)
    plan = plan_tools(req, ctx.tool_parser)
    if plan.mode == "auto" and plan.parser is not None and not plan.parser.skip_special_tokens:
        fields["skip_special_tokens"] = False  # NOTE: its call marker is a special token
    if plan.constraint() is not None:
        if fields["structured_outputs"] is not None:
            raise bad_request("A tool call and another output constraint cannot be combined.",
                              structured_param)
        fields["structured_outputs"], structured_param = plan.constraint(), "tools"
    # NOTE: vLLM's --exclude-tools-when-tool-choice-none: such a request's template sees no tools
    shown = None if req.tool_choice == "none" and ctx.exclude_tools_when_tool_choice_none else plan
    forwarded = _forwarded_prompt(req)
    if forwarded is None:
        text = await render_chat(ctx, req.messages, req.add_generation_prompt,
                                 chat_template_kwargs_of(req), shown, chat_template_for(ctx, req),
                                 req.continue_final_message)
        forwarded = Prompt(await tokenize_text(ctx, text, req.add_special_tokens, "messages"), text)
    prompt = truncate_prompt(forwarded, req.truncate_prompt_tokens, ctx.max_model_len, req.truncation_side)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    role = ctx.response_role if req.add_generation_prompt else req.messages[-1].role
    return ChatInputs(plan, fields, structured_param, prompt, max_tokens, role, _echo(req, role))


def chat_template_kwargs_of(req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's chat template variables, as vLLM merges them: `chat_template_kwargs`, then
    `documents` and `reasoning_effort` where given, and `enable_thinking` (false only for the
    effort "none") where a reasoning effort is given and chat_template_kwargs leaves it unset."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    return kwargs


def _forwarded_prompt(req: ChatCompletionRequest) -> Prompt | None:
    """vLLM's `kv_transfer_params.prompt_token_ids`: the prefill stage's prompt, taken as it is
    (the messages are not rendered); None where the request forwards none."""
    ids = (req.kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("kv_transfer_params.prompt_token_ids must be a non-empty list of token ids.",
                          "kv_transfer_params")
    return Prompt(ids)


def _echo(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text where it has the answer's role, else none."""
    last = req.messages[-1]
    if not req.echo or last.role != role or not last.content:
        return ""
    content = last.content
    return content if isinstance(content, str) else "\n".join(str(p.get("text", "")) for p in content)


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, inputs: ChatInputs,
                     ids: RequestIds) -> Generation:
    """The chat's `Generation`, validated and admitted (400s, 429)."""
    params = build_sampling_params(ctx, inputs.fields, len(inputs.prompt.token_ids),
                                   inputs.max_tokens, num_logprobs_of(req))
    return await Generation.create(ctx, ids.engine, [inputs.prompt], [params],
                                   inputs.structured_param, req.priority, req.user, req.cache_salt,
                                   ctx.lora_for(req.model), reasoning_end(ctx, req), ids.response)


def reasoning_end(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[int, ...]:
    """The tokens that end the model's thinking where the chat's answer starts with it (a
    reasoning parser, and for qwen3 `enable_thinking` not false): as vLLM, an output constraint
    (tools, response_format) holds only after them; none otherwise."""
    parser = ctx.reasoning_parser
    if parser is None:
        return ()
    kwargs = {**ctx.default_chat_template_kwargs, **chat_template_kwargs_of(req)}
    if not parser.opens_in_reasoning and kwargs.get("enable_thinking", True) is False:
        return ()
    return end_of_thinking(ctx)


def end_of_thinking(ctx: ServerContext) -> tuple[int, ...]:
    """`</think>`'s tokens."""
    return tuple(ctx.tokenizer.encode(END, add_special_tokens=False))


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request
                                 ) -> Response:
    check_lora_model(ctx, req.model, req.use_beam_search)
    inputs = await chat_inputs(ctx, req)
    if req.use_beam_search:
        return await _beam_search_chat(ctx, req, raw, inputs)
    gen = await start_chat(ctx, req, inputs, api_request_ids("chatcmpl", raw, req.request_id))
    model = req.model or ctx.model_name
    num_logprobs = num_logprobs_of(req)
    num_logprobs = None if num_logprobs is None else shown_logprobs(req, num_logprobs)
    if req.stream:
        return StreamingResponse(sse(stream_chat(gen, req, model, num_logprobs, inputs)),
                                 media_type="text/event-stream")
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    response = full_chat(gen, model, num_logprobs, inputs, TokenNames.of_request(ctx, req),
                         bool(req.return_token_ids), req.include_reasoning)
    response.prompt_text = inputs.prompt.text if req.return_prompt_text else None
    return JSONResponse(response.model_dump())


async def _beam_search_chat(ctx: ServerContext, req: ChatCompletionRequest, raw: Request,
                            inputs: ChatInputs) -> Response:
    """vLLM's `use_beam_search` on chat: `n` beams, best first, as `n` choices."""
    if req.logprobs or inputs.plan.mode != "none" \
            or inputs.fields.get("structured_outputs") is not None:
        raise bad_request("use_beam_search returns no logprobs, and takes no tools or output constraint.",
                          "use_beam_search")
    prompt = inputs.prompt
    params = beam_search_params(ctx, req, [prompt], inputs.max_tokens, req.length_penalty)
    ids = api_request_ids("chatcmpl", raw, req.request_id)
    results = await run_beam_search(ctx, raw, ids.engine, [prompt], params, req)
    if results is None:
        return Response(status_code=499)
    choices = [ChatCompletionResponseChoice(
        index=j, message=AssistantMessage(role=inputs.role, content=beam.text or ""), finish_reason=beam.finish_reason,
        token_ids=beam.tokens[len(prompt.token_ids):] if req.return_token_ids else None)
        for j, beam in enumerate(results[0].sequences)]
    return JSONResponse(ChatCompletionResponse(
        id=ids.response, model=req.model or ctx.model_name, choices=choices, usage=beam_usage([prompt], results),
        prompt_token_ids=list(prompt.token_ids) if req.return_token_ids else None).model_dump())


def _finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    # NOTE: OpenAI answers "stop" for a forced (named) function, "tool_calls" otherwise.
    return "tool_calls" if called and plan.mode != "named" and reason == "stop" else reason


def full_chat(gen: Generation, model: str, num_logprobs: int | None, inputs: ChatInputs, names: TokenNames,
              return_token_ids: bool = False, include_reasoning: bool = True) -> ChatCompletionResponse:
    choices = [chat_choice_of(gen.ctx, index, state, inputs, names, num_logprobs, return_token_ids,
                              include_reasoning)
               for index, state in enumerate(gen.choices)]
    return ChatCompletionResponse(
        id=gen.response_id, created=gen.created, model=model, choices=choices, usage=gen.usage(),
        prompt_logprobs=prompt_logprobs_field(gen.prompt_logprobs[0]),
        prompt_token_ids=list(gen.prompts[0].token_ids) if return_token_ids else None)


def chat_choice_of(ctx: ServerContext, index: int, state: ChoiceState, inputs: ChatInputs, names: TokenNames,
                   num_logprobs: int | None, return_token_ids: bool,
                   include_reasoning: bool) -> ChatCompletionResponseChoice:
    """One finished choice as the response's: its reasoning split off, its tool calls parsed,
    the echoed text first, its logprobs and token ids where asked."""
    plan, parser = inputs.plan, ctx.reasoning_parser
    logprobs = None
    if num_logprobs is not None:
        logprobs = chat_logprobs(names, state.token_ids, state.logprobs, num_logprobs)
    thought, text = split(parser, state.text) if parser is not None else (None, state.text)
    thought = thought if include_reasoning else None
    content, calls = parse_calls(plan, text or "") if plan.calls_tools else (text, [])
    if plan.mode in ("named", "required"):
        # NOTE: a forced call's content is "" (vLLM's), and one cut by max_tokens is no call (OpenAI's)
        content, calls = (content or "", calls) if state.finish_reason != "length" else ("", [])
    content = inputs.echo + (content or "") if inputs.echo else content
    return ChatCompletionResponseChoice(
        index=index, message=AssistantMessage(role=inputs.role, content=content, tool_calls=calls,
                                              reasoning=thought, reasoning_content=thought),
        logprobs=logprobs, finish_reason=_finish_reason(plan, state.finish_reason, bool(calls)),
        stop_reason=state.stop_reason, token_ids=list(state.token_ids) if return_token_ids else None)


async def stream_chat(gen: Generation, req: ChatCompletionRequest, model: str,
                      num_logprobs: int | None, inputs: ChatInputs) -> AsyncIterator[str]:
    """The chunks' JSON: a role chunk per choice (and the echoed last message's text, when
    asked), then one per content or tool-call delta, then the usage chunk if asked for."""
    plan, names = inputs.plan, TokenNames.of_request(gen.ctx, req)
    chunks = ChunkEncoder(gen.response_id, "chat.completion.chunk", gen.created, model)
    final_usage, continuous = stream_usage(gen.ctx, req)

    def chunk(choice: str, extra: str = "") -> str:
        return chunks.encode(choice, part_json(gen.usage() if continuous else None), extra)

    streams = [ToolStream(plan) for _ in gen.choices]
    parser = gen.ctx.reasoning_parser
    thinking = [ReasoningStream(parser) for _ in gen.choices] if parser is not None else None
    # NOTE: vLLM's stream: the prompt's ids in the first chunk, a delta's ids in its chunk.
    prompt_ids = ids_members(prompt_token_ids=gen.prompts[0].token_ids if req.return_token_ids else None,
                             prompt_text=gen.prompts[0].text if req.return_prompt_text else None)
    for index in range(len(gen.choices)):
        yield chunk(chat_choice(index, role_delta(inputs.role)), prompt_ids if index == 0 else "")
    for index in range(len(gen.choices) if inputs.echo else 0):
        yield chunk(chat_choice(index, content_delta(inputs.echo)))
    async for index, delta in gen.deltas():
        # NOTE: a delta whose text is held back (a character's first bytes) still carries its
        # token ids and logprobs, in a chunk with an empty delta, as vLLM streams it
        carries_tokens = (num_logprobs is not None or bool(req.return_token_ids)) and bool(delta.token_ids)
        if not (delta.text or delta.finish_reason or carries_tokens):
            continue
        logprobs = NULL
        if num_logprobs is not None:
            logprobs = part_json(chat_logprobs(names, delta.token_ids, delta.logprobs or [],
                                               num_logprobs))
        final, text, pieces, called = delta.finish_reason is not None, delta.text, [], False
        if thinking is not None:
            thought, text = thinking[index].step(text, final)
            if thought and req.include_reasoning:
                pieces.append(reasoning_delta(thought))
        if plan.calls_tools:
            tool_pieces, called = _tool_pieces(streams[index], text, final)
            pieces += tool_pieces
        elif text:
            pieces.append(content_delta(text))
        pieces = pieces or [content_delta("")]
        ids = ids_members(token_ids=list(delta.token_ids)) if req.return_token_ids else ""
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield chunk(chat_choice(
                index, piece, logprobs if i == 0 else NULL,
                _finish_reason(plan, delta.finish_reason, called) if last else None,
                delta.stop_reason if last else None, ids if i == 0 else ""))
    if final_usage:
        yield chunks.encode(None, part_json(gen.usage()))


def _tool_pieces(stream: ToolStream, text: str, final: bool) -> tuple[list[str], bool]:
    """The delta's content and tool-call pieces (JSON), and whether the choice called tools."""
    messages, called = stream.step(text, final)
    return [part_json(message) for message in messages], called
