"""POST /v1/completions: a prompt (text, texts, token ids or lists of them) in, text out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.outputs import Logprob
from pagoda.server.chunks import NULL, ChunkEncoder, completion_choice, part_json
from pagoda.server.errors import bad_request
from pagoda.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    random_id,
)
from pagoda.server.serving import (
    Generation,
    Prompt,
    ServerContext,
    build_sampling_params,
    request_fields,
    token_str,
    tokenize_text,
    top_entries,
    truncate_prompt,
)
from pagoda.server.streaming import sse, until_disconnect


async def completion_prompts(ctx: ServerContext,
                             prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """Normalizes the four prompt shapes OpenAI allows into tokenized prompts."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise bad_request("The prompt cannot be empty.", "prompt")
    if all(isinstance(t, int) for t in items):
        items = [items]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(await tokenize_text(ctx, item), item))
        else:
            prompts.append(Prompt(list(item)))
    return prompts


def echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    if prompt.text is None:
        prompt.text = str(ctx.tokenizer.decode(prompt.token_ids))
    return prompt.text


def completion_logprobs(ctx: ServerContext, token_ids: list[int], entries: list[dict[int, Logprob]],
                        num: int, offset: int) -> CompletionLogProbs:
    """The legacy logprobs object: per token its string, offset, logprob and the top-`num`."""
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        token = token_str(ctx, sampled) if sampled else str(ctx.tokenizer.decode([token_id]))
        out.text_offset.append(offset)
        offset += len(token)
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob if sampled else None)
        tops = top_entries(entry, num)
        if sampled is not None and sampled not in tops:
            tops.append(sampled)
        out.top_logprobs.append({token_str(ctx, lp): lp.logprob for lp in tops})
    return out


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported.", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    fields, structured_param = request_fields(req)
    prompts = [truncate_prompt(p, req.truncate_prompt_tokens, ctx.max_model_len)
               for p in await completion_prompts(ctx, req.prompt)]
    params = [build_sampling_params(ctx, fields, len(p.token_ids), req.max_tokens, req.logprobs)
              for p in prompts]
    gen = await Generation.create(ctx, random_id("cmpl"), prompts, params, structured_param,
                                  req.priority, req.user)
    model = req.model or ctx.model_name
    if req.stream:
        return StreamingResponse(sse(stream_completion(gen, req, model)),
                                 media_type="text/event-stream")
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    return JSONResponse(full_completion(gen, req, model).model_dump())


def full_completion(gen: Generation, req: CompletionRequest, model: str) -> CompletionResponse:
    ctx, choices = gen.ctx, []
    for index, state in enumerate(gen.choices):
        prefix = echo_text(ctx, gen.prompts[index // gen.n]) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx, state.token_ids, state.logprobs, req.logprobs, 0)
        choices.append(CompletionResponseChoice(
            index=index, text=prefix + state.text, logprobs=logprobs,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason))
    return CompletionResponse(id=gen.request_id, created=gen.created, model=model,
                              choices=choices, usage=gen.usage())


async def stream_completion(gen: Generation, req: CompletionRequest, model: str
                            ) -> AsyncIterator[str]:
    """The chunks' JSON: one per delta, then the usage chunk if asked for."""
    ctx, echoed = gen.ctx, set()
    chunks = ChunkEncoder(gen.request_id, "text_completion", gen.created, model)
    async for index, delta in gen.deltas():
        text = delta.text
        if req.echo and index not in echoed:
            echoed.add(index)
            text = echo_text(ctx, gen.prompts[index // gen.n]) + text
        logprobs = NULL
        if req.logprobs is not None:
            offset = len(gen.choices[index].text) - len(delta.text)
            logprobs = part_json(completion_logprobs(ctx, delta.token_ids, delta.logprobs or [],
                                                     req.logprobs, offset))
        choice = completion_choice(index, text, logprobs, delta.finish_reason, delta.stop_reason)
        yield chunks.encode(choice, part_json(gen.usage() if req.continuous_usage else None))
    if req.include_usage:
        yield chunks.encode(None, part_json(gen.usage()))
