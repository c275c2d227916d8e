"""POST /v1/completions: a prompt (text, texts, token ids or lists of them) in, text out.

With `echo` the prompt leads the text and, with `logprobs`, its tokens' scores lead the
logprobs (vLLM: `echo` sets `prompt_logprobs` to `logprobs`); `max_tokens=0` with `echo`
returns only that (lm-eval's loglikelihood request).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.outputs import Logprob
from pagoda.server.chunks import NULL, ChunkEncoder, completion_choice, ids_members, part_json
from pagoda.server.errors import bad_request
from pagoda.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from pagoda.server.serving import (
    Generation,
    Prompt,
    ServerContext,
    TokenNames,
    api_request_ids,
    beam_search_params,
    beam_usage,
    build_sampling_params,
    check_lora_model,
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


async def completion_prompts(ctx: ServerContext, prompt: str | list[str] | list[int] | list[list[int]],
                             add_special_tokens: bool = True) -> list[Prompt]:
    """Normalizes the four prompt shapes OpenAI allows into tokenized prompts (text with the
    tokenizer's special tokens, e.g. BOS, unless `add_special_tokens` is false: vLLM's field)."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise bad_request("The prompt cannot be empty.", "prompt")
    if all(isinstance(t, int) for t in items):
        items = [items]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(await tokenize_text(ctx, item, add_special_tokens), item))
        else:
            prompts.append(Prompt(list(item)))
    return prompts


def echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    if prompt.text is None:
        prompt.text = str(ctx.tokenizer.decode(prompt.token_ids))
    return prompt.text


def completion_logprobs(names: TokenNames, token_ids: list[int],
                        entries: list[dict[int, Logprob] | None], num: int,
                        offset: int) -> CompletionLogProbs:
    """The legacy logprobs object: per token its string, offset, logprob and the top-`num`
    (null for a token nothing scored: an echoed prompt's first)."""
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id) if entry is not None else None
        token = names.of_logprob(sampled) if sampled else names.of_id(token_id)
        out.text_offset.append(offset)
        offset += len(token)
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob if sampled else None)
        if entry is None:
            out.top_logprobs.append(None)
            continue
        tops = top_entries(entry, num)
        if sampled is not None and sampled not in tops:
            tops.append(sampled)
        out.top_logprobs.append({names.of_logprob(lp): lp.logprob for lp in tops})
    return out


def scores_prompt_only(req: CompletionRequest) -> bool:
    """vLLM's `max_tokens=0` with echo (lm-eval's loglikelihood): the prompt and its scores
    only; one token is sampled and never shown."""
    return req.echo and req.max_tokens == 0


def choice_tokens(gen: Generation, req: CompletionRequest, index: int, text: str,
                  token_ids: list[int], entries: list[dict[int, Logprob]], echo: bool
                  ) -> tuple[str, list[int], list[dict[int, Logprob] | None]]:
    """A choice's (part of) text, token ids and logprob entries: the prompt first when
    echoing it (`echo`), its scores as logprobs (vLLM's null first); nothing generated when
    only the prompt is scored."""
    shown: list[dict[int, Logprob] | None] = list(entries)
    if scores_prompt_only(req):
        text, token_ids, shown = "", [], []
    if not echo:
        return text, token_ids, shown
    i = index // gen.n
    prompt = gen.prompts[i]
    scores = gen.prompt_logprobs[i] or [None] * len(prompt.token_ids)
    return echo_text(gen.ctx, prompt) + text, prompt.token_ids + token_ids, scores + shown


def finish(req: CompletionRequest, reason: str | None,
           stop_reason: int | str | None) -> tuple[str | None, int | str | None]:
    if scores_prompt_only(req) and reason in ("stop", "length"):
        return "length", None
    return reason, stop_reason


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    lora = check_lora_model(ctx, req.model, req.use_beam_search)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    fields, structured_param = request_fields(req)
    if req.logprob_token_ids and scores_prompt_only(req):
        raise bad_request("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                          "no output tokens are generated.", "logprob_token_ids")
    if req.echo and fields.get("prompt_logprobs") is None:
        # NOTE: vLLM's rule: an echoed prompt is scored with as many alternatives as `logprobs`.
        fields["prompt_logprobs"] = req.logprobs
    max_tokens = 1 if scores_prompt_only(req) else req.max_tokens
    prompts = [truncate_prompt(p, req.truncate_prompt_tokens, ctx.max_model_len, req.truncation_side)
               for p in await completion_prompts(ctx, req.prompt, req.add_special_tokens)]
    if req.use_beam_search:
        return await beam_search_completion(ctx, req, raw, prompts)
    params = [build_sampling_params(ctx, fields, len(p.token_ids), max_tokens, req.logprobs)
              for p in prompts]
    ids = api_request_ids("cmpl", raw, req.request_id)
    gen = await Generation.create(ctx, ids.engine, prompts, params, structured_param,
                                  req.priority, req.user, req.cache_salt, lora, response_id=ids.response)
    model = req.model or ctx.model_name
    if req.stream:
        return StreamingResponse(sse(stream_completion(gen, req, model)),
                                 media_type="text/event-stream")
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    return JSONResponse(full_completion(gen, req, model).model_dump())


def full_completion(gen: Generation, req: CompletionRequest, model: str) -> CompletionResponse:
    ctx, choices = gen.ctx, []
    names = TokenNames.of_request(ctx, req)
    for index, state in enumerate(gen.choices):
        text, token_ids, entries = choice_tokens(gen, req, index, state.text, state.token_ids,
                                                 state.logprobs, req.echo)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(names, token_ids, entries, shown_logprobs(req, req.logprobs), 0)
        reason, stop_reason = finish(req, state.finish_reason, state.stop_reason)
        prompt = gen.prompts[index // gen.n]
        choices.append(CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=reason,
            stop_reason=stop_reason,
            prompt_logprobs=prompt_logprobs_field(gen.prompt_logprobs[index // gen.n]),
            token_ids=list(state.token_ids) if req.return_token_ids else None,
            prompt_token_ids=list(prompt.token_ids) if req.return_token_ids else None))
    return CompletionResponse(id=gen.response_id, created=gen.created, model=model,
                              choices=choices, usage=gen.usage())


async def stream_completion(gen: Generation, req: CompletionRequest, model: str
                            ) -> AsyncIterator[str]:
    """The chunks' JSON: one per delta (the first of a choice led by the echoed prompt and its
    scores, as vLLM streams it), then the usage chunk if asked for."""
    ctx, echoed = gen.ctx, set()
    chunks = ChunkEncoder(gen.response_id, "text_completion", gen.created, model)
    final_usage, continuous = stream_usage(ctx, req)
    names = TokenNames.of_request(ctx, req)
    async for index, delta in gen.deltas():
        first = index not in echoed
        echo = req.echo and first
        echoed.add(index)
        text, token_ids, entries = choice_tokens(gen, req, index, delta.text, delta.token_ids,
                                                 delta.logprobs or [], echo)
        logprobs = NULL
        if req.logprobs is not None:
            offset = 0 if echo else len(gen.choices[index].text) - len(delta.text)
            logprobs = part_json(completion_logprobs(names, token_ids, entries, shown_logprobs(req, req.logprobs),
                                                     offset))
        reason, stop_reason = finish(req, delta.finish_reason, delta.stop_reason)
        extra = ""
        if req.return_token_ids:
            # NOTE: vLLM's stream: the prompt's ids in a choice's first chunk only.
            prompt_ids = gen.prompts[index // gen.n].token_ids if first else None
            extra = ids_members(token_ids=list(delta.token_ids), prompt_token_ids=prompt_ids)
        choice = completion_choice(index, text, logprobs, reason, stop_reason, extra)
        yield chunks.encode(choice, part_json(gen.usage() if continuous else None))
    if final_usage:
        yield chunks.encode(None, part_json(gen.usage()))


async def beam_search_completion(ctx: ServerContext, req: CompletionRequest, raw: Request,
                                 prompts: list[Prompt]) -> Response:
    """vLLM's `use_beam_search`: `n` beams per prompt, best first, in one response."""
    if req.echo or req.logprobs is not None:
        raise bad_request("use_beam_search returns no logprobs and echoes no prompt.", "use_beam_search")
    params = beam_search_params(ctx, req, prompts, req.max_tokens, req.length_penalty)
    ids = api_request_ids("cmpl", raw, req.request_id)
    results = await run_beam_search(ctx, raw, ids.engine, prompts, params, req)
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        for j, beam in enumerate(result.sequences):
            generated = beam.tokens[len(prompt.token_ids):]
            choices.append(CompletionResponseChoice(
                index=i * params.beam_width + j, text=beam.text or "", finish_reason=beam.finish_reason,
                token_ids=generated if req.return_token_ids else None,
                prompt_token_ids=list(prompt.token_ids) if req.return_token_ids else None))
    return JSONResponse(CompletionResponse(id=ids.response, model=req.model or ctx.model_name, choices=choices,
                                           usage=beam_usage(prompts, results)).model_dump())
