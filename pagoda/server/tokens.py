"""vLLM's token-in, token-out API: a prompt rendered once, then generated from its token ids.

- `POST /v1/completions/render`, `/v1/chat/completions/render`, `/v1/responses/render` and
  `/v1/messages/render` check a completion, chat, Responses or Anthropic Messages request as its
  route would (fields, tools, template, context length) and answer what
  `/inference/v1/generate` takes: the prompt's token ids and the `SamplingParams` as vLLM's
  JSON (its non-default fields), one per prompt for completions; nothing runs.
- `POST /inference/v1/generate` runs token ids with such params and answers token ids
  (`output_mode` "tokens", logprobs by token id) or also the text ("text", logprobs as chat's),
  whole or streamed as vLLM's chunks. A client that renders or tokenizes on its side (an RL
  trainer, a disaggregated frontend) gets exactly the tokens it sent and the ones generated.
- `POST /inference/v1/abort_requests` (and vLLM's older `/abort_requests`) aborts requests by
  the ids their responses carry.
As vLLM's, the routes answer 403 unless the server runs with `--enable-scale-out` (or
`--tokens-only`, which also refuses what needs the text and serves `/abort_requests`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.outputs import CompletionOutput, Logprob
from pagoda.sampling_params import WHOLE_VOCABULARY, SamplingParams
from pagoda.server.chat import (
    chat_inputs,
    chat_logprobs,
    end_of_thinking,
    num_logprobs_of,
    reasoning_end,
)
from pagoda.server.completions import completion_prompts
from pagoda.server.constraints import check_supported
from pagoda.server.errors import APIError, bad_request, invalid_fields
from pagoda.server.messages import chat_request_of, inline_system_merged
from pagoda.server.messages_protocol import AnthropicMessagesRequest
from pagoda.server.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo
from pagoda.server.responses import chat_messages, chat_request, responses_params
from pagoda.server.responses_protocol import ResponsesRequest, response_id
from pagoda.server.serving import (
    Generation,
    Prompt,
    ServerContext,
    TokenNames,
    api_request_ids,
    build_sampling_params,
    check_lora_model,
    invalid_input,
    prompt_logprobs_field,
    request_fields,
    top_entries,
    truncate_prompt,
)
from pagoda.server.streaming import sse, until_disconnect
from pagoda.server.tokens_protocol import GenerateRequest, GenerateSamplingParams
from pagoda.structured_output import StructuredOutputsParams

# NOTE: pagoda's own resolutions of a request's fields, never taken from a client
_INTERNAL = {"watermark_status", "bad_words_token_ids", "thinking_budget"}
SHARED = {f.name for f in dataclasses.fields(SamplingParams)} - _INTERNAL
# NOTE: vLLM's SamplingParams fields pagoda has no use for, at the value that asks for nothing
# (`output_kind` is the route's, by `stream`; `detokenize` false only drops text pagoda's token
# mode never sends)
VLLM_DEFAULTS: dict[str, Any] = {
    "prompt_logprob_token_ids": None, "prompt_logprob_start": None, "flat_logprobs": False,
    "skip_clone": False, "output_text_buffer_length": 0, "extra_args": None,
    "skip_reading_prefix_cache": False, "routed_experts_prompt_start": 0, "trace_decode_token_ids": None}
ANY_VALUE = ("output_kind", "detokenize")
# NOTE: vLLM's StructuredOutputsParams members pagoda's lacks, at vLLM's defaults
STRUCTURED_DEFAULTS: dict[str, Any] = {"disable_additional_properties": False, "structural_tag": None,
                                       "_backend": None, "_backend_was_auto": False}


SCALE_OUT_DISABLED = ("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                      "to enable them.")


def check_enabled(ctx: ServerContext) -> None:
    """vLLM's 403 (its words) where the server runs without --enable-scale-out (api.py checks
    it before a body is read)."""
    if not ctx.enable_scale_out:
        raise APIError(403, SCALE_OUT_DISABLED, error_type="PermissionDeniedError")


# ---- render -------------------------------------------------------------------------------


def sampling_params_json(params: SamplingParams) -> dict[str, Any]:
    """`params` as vLLM writes a `SamplingParams` (its fields that differ from the defaults),
    with `max_tokens` always: vLLM's JSON leaves out a max_tokens of 16 (its default), which its
    generate route then reads as unset and fills from the context."""
    default = SamplingParams()
    out: dict[str, Any] = {}
    for name in sorted(SHARED):
        value = getattr(params, name)
        if value is None if name == "max_tokens" else value == getattr(default, name):
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)  # type: ignore[arg-type]
        out[name] = value
    return out


def token_offsets(ctx: ServerContext, whole: Prompt, kept: Prompt, add_special_tokens: bool,
                  side: str | None) -> list[tuple[int, int]] | None:
    """vLLM's `return_token_offsets`: each kept token's (start, end) in the text it came from
    (None for a prompt sent as token ids, or where the tokenizer's offsets do not line up)."""
    if whole.text is None:
        return None
    encoded = ctx.tokenizer(whole.text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    if encoded["input_ids"] != whole.token_ids:
        return None
    offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
    n = len(kept.token_ids)
    return offsets[:n] if side == "right" else offsets[len(offsets) - n:]


def _generate_request(request_id: str, prompt: Prompt, params: SamplingParams, model: str | None,
                      stream: bool, req: CompletionRequest | ChatCompletionRequest,
                      reasoning_ended: bool | None = None,
                      offsets: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "token_ids": list(prompt.token_ids), "token_offsets": offsets,
            "features": None, "content_parts": None, "sampling_params": sampling_params_json(params),
            "model": model, "reasoning_ended": reasoning_ended, "reasoning_parser_kwargs": None,
            "return_token_ids": None, "output_mode": "tokens", "stream": stream,
            "stream_options": req.stream_options.model_dump() if stream and req.stream_options else None,
            "cache_salt": req.cache_salt, "priority": req.priority, "kv_transfer_params": None,
            "ec_transfer_params": None}


async def render_completion_request(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    """One `/inference/v1/generate` request per prompt (vLLM's `/v1/completions/render`)."""
    check_lora_model(ctx, req.model, req.use_beam_search)
    if req.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", "use_beam_search")
    if req.echo or req.suffix:
        raise bad_request("echo and suffix are not supported by the render endpoint", "echo")
    fields, _ = request_fields(req)
    wholes = await completion_prompts(ctx, req.prompt, req.add_special_tokens)
    base = api_request_ids("cmpl", raw, req.request_id).response
    out = []
    for i, whole in enumerate(wholes):
        prompt = truncate_prompt(whole, req.truncate_prompt_tokens, ctx.max_model_len, req.truncation_side)
        params = _checked(ctx, build_sampling_params(ctx, fields, len(prompt.token_ids), req.max_tokens,
                                                     req.logprobs))
        rid = base if len(wholes) == 1 else f"{base}-{i}"
        offsets = (token_offsets(ctx, whole, prompt, req.add_special_tokens, req.truncation_side)
                   if req.return_token_offsets else None)
        out.append(_generate_request(rid, prompt, params, req.model, req.stream, req, offsets=offsets))
    return JSONResponse(out)


async def render_chat_request(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    """The conversation's `/inference/v1/generate` request (vLLM's `/v1/chat/completions/render`):
    rendered and tokenized as the chat route does, `reasoning_ended` true where its output
    constraint would hold from the first token."""
    check_lora_model(ctx, req.model, req.use_beam_search)
    if req.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", "use_beam_search")
    inputs = await chat_inputs(ctx, req)
    params = _checked(ctx, build_sampling_params(ctx, inputs.fields, len(inputs.prompt.token_ids),
                                                 inputs.max_tokens, num_logprobs_of(req)))
    rid = api_request_ids("chatcmpl", raw, req.request_id).response
    gated = params.structured_outputs is not None and bool(reasoning_end(ctx, req))
    # NOTE: offsets within the rendered template (the chat route keeps its text where it cut nothing)
    offsets = (token_offsets(ctx, inputs.prompt, inputs.prompt, req.add_special_tokens, None)
               if req.return_token_offsets else None)
    return JSONResponse(_generate_request(rid, inputs.prompt, params, req.model, req.stream, req,
                                          reasoning_ended=not gated, offsets=offsets))


async def render_responses_request(ctx: ServerContext, req: ResponsesRequest) -> Response:
    """The Responses request's `/inference/v1/generate` request (vLLM's `/v1/responses/render`):
    its input rendered as `/v1/responses` renders it; stateless, so no previous response."""
    ctx.lora_for(req.model)
    check_supported(req)
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported by the stateless render endpoint.",
                       "previous_response_id", error_type="invalid_request_error")
    with responses_params():
        chat = chat_request(req, chat_messages(req.input))
        inputs = await chat_inputs(ctx, chat)
        params = _checked(ctx, build_sampling_params(ctx, inputs.fields, len(inputs.prompt.token_ids),
                                                     inputs.max_tokens, num_logprobs_of(chat)))
    gated = params.structured_outputs is not None and bool(reasoning_end(ctx, chat))
    return JSONResponse(_generate_request(response_id("resp"), inputs.prompt, params, req.model, req.stream,
                                          chat, reasoning_ended=not gated))


async def render_messages_request(ctx: ServerContext, req: AnthropicMessagesRequest, raw: Request) -> Response:
    """The Messages request's `/inference/v1/generate` request (vLLM's `/v1/messages/render`):
    converted to a chat request as `/v1/messages` converts it, then rendered as a chat."""
    return await render_chat_request(ctx, chat_request_of(req, await inline_system_merged(ctx)), raw)


def _checked(ctx: ServerContext, params: SamplingParams) -> SamplingParams:
    """Params as the engine would take them (its 400s now, not at generate)."""
    try:
        ctx.processor.check_params(params)
    except ValueError as e:
        raise invalid_input(e) from e
    return params


# ---- generate -----------------------------------------------------------------------------


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `SamplingParams` JSON as pagoda's keywords; a field pagoda does not take is a 400
    naming it (vLLM's own ones pass at their default value)."""
    fields: dict[str, Any] = {}
    for name, value in body.items():
        param = f"sampling_params.{name}"
        if name in SHARED:
            fields[name] = value
        elif name in ANY_VALUE or (name in VLLM_DEFAULTS and value == VLLM_DEFAULTS[name]):
            continue
        elif name in VLLM_DEFAULTS:
            raise bad_request(f"{param} is not supported by pagoda (only its default, "
                              f"{json.dumps(VLLM_DEFAULTS[name])}).", param)
        else:
            raise bad_request(f"Unknown sampling parameter {param}.", param)
    try:
        typed = GenerateSamplingParams.model_validate(fields)
    except ValidationError as e:
        raise invalid_fields(e.errors(), "sampling_params.") from e
    fields = typed.model_dump(exclude_unset=True)
    if typed.repetition_detection is not None:
        fields["repetition_detection"] = typed.repetition_detection.model_dump()
    if typed.structured_outputs is not None:
        fields["structured_outputs"] = _structured(typed.structured_outputs)
    return fields


def _structured(spec: dict[str, Any]) -> StructuredOutputsParams:
    param = "sampling_params.structured_outputs"
    kept = {}
    for name, value in spec.items():
        if name in STRUCTURED_DEFAULTS:
            if value != STRUCTURED_DEFAULTS[name] and not name.startswith("_"):
                raise bad_request(f"{param}.{name} is not supported by pagoda.", param)
        else:
            kept[name] = value
    try:
        return StructuredOutputsParams(**kept)
    except (TypeError, ValueError) as e:
        raise bad_request(f"Invalid {param}: {e}", param) from e


async def generate(ctx: ServerContext, req: GenerateRequest, raw: Request) -> Response:
    """vLLM's `/inference/v1/generate`."""
    check_supported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    lora = ctx.lora_for(req.model)
    fields = sampling_fields(req.sampling_params)
    if ctx.tokens_only:
        _check_tokens_only(req, fields)
    if fields.get("stop") and req.sampling_params.get("detokenize") is False:
        raise bad_request("stop strings are only supported when detokenize is True. Set "
                          "detokenize=True to use stop.", "sampling_params.stop")
    if req.output_mode == "text" and req.sampling_params.get("detokenize") is False:
        raise bad_request("output_mode='text' requires sampling_params.detokenize to be true",
                          "output_mode")
    max_tokens, logprobs = fields.pop("max_tokens", None), fields.pop("logprobs", None)
    bad = next((t for t in req.token_ids if t < 0), None)
    if bad is not None:
        raise bad_request("token_ids must not contain negative values", "token_ids")
    prompt = Prompt(list(req.token_ids))
    params = build_sampling_params(ctx, fields, len(prompt.token_ids), max_tokens, logprobs)
    gated = ctx.reasoning_parser is not None and req.reasoning_ended is not True
    ids = api_request_ids("generate-tokens", raw, req.request_id)
    gen = await Generation.create(ctx, ids.engine, [prompt], [params], "sampling_params.structured_outputs",
                                  req.priority, None, req.cache_salt, lora,
                                  end_of_thinking(ctx) if gated else (), ids.response)
    model = req.model or ctx.model_name
    if req.stream:
        return StreamingResponse(sse(_stream(gen, req)), media_type="text/event-stream")
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    return JSONResponse(_whole(gen, req, model))


def _check_tokens_only(req: GenerateRequest, fields: dict[str, Any]) -> None:
    """vLLM's --tokens-only 400s (its words): nothing that needs the text."""
    if fields.get("stop"):
        raise bad_request("stop strings are not supported on a --tokens-only server because "
                          "detokenization is disabled. Check stop strings on the coordinator, or "
                          "use stop_token_ids.", "sampling_params.stop")
    if req.output_mode != "tokens":
        raise bad_request(f"output_mode={req.output_mode!r} requires a tokenizer, but this server does "
                          "not load one (--tokens-only or --skip-tokenizer-init). Send the request to a "
                          "server that loads a tokenizer, or use output_mode='tokens'.", "output_mode")


def _choice_logprobs(gen: Generation, req: GenerateRequest, token_ids: list[int],
                     entries: list[dict[int, Logprob]]) -> dict[str, Any] | None:
    """vLLM's: by token id (tokens mode: the sampled one with its top candidates), or chat's
    shape with the tokens' text (text mode)."""
    num = gen.requests[0].sampling_params.logprobs
    if num is None:
        return None
    if req.output_mode == "text":
        names = TokenNames(gen.ctx.tokenizer, gen.ctx.return_tokens_as_token_ids)
        return chat_logprobs(names, token_ids, entries, num).model_dump()
    content: list[dict[str, Any]] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        if sampled is None:
            content.append({"token_id": token_id, "logprob": -9999.0, "rank": None, "top_logprobs": []})
            continue
        # NOTE: vLLM's order: the sampled token first, then the others by rank
        tops = [sampled, *(lp for lp in top_entries(entry, WHOLE_VOCABULARY) if lp is not sampled)]
        shown = tops if num == WHOLE_VOCABULARY else tops[:max(num, 1)]
        content.append({**_logprob(sampled), "top_logprobs": [_logprob(lp) for lp in shown]})
    return {"content": content}


def _logprob(lp: Logprob) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": max(lp.logprob, -9999.0), "rank": lp.rank or None}


def _choice(gen: Generation, req: GenerateRequest, index: int, text: str, token_ids: list[int],
            entries: list[dict[int, Logprob]], finish_reason: str | None,
            stop_reason: int | str | None) -> dict[str, Any]:
    choice = {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
              "token_ids": list(token_ids), "routed_experts": None, "sampling_mask": None,
              "weight_versions": None, "logprobs": _choice_logprobs(gen, req, token_ids, entries)}
    if req.output_mode == "text":
        choice["text"] = text
    return choice


def _whole(gen: Generation, req: GenerateRequest, model: str) -> dict[str, Any]:
    choices = [_choice(gen, req, i, c.text, c.token_ids, c.logprobs, c.finish_reason or "stop", c.stop_reason)
               for i, c in enumerate(gen.choices)]
    return {"request_id": gen.response_id, "model": model, "created": gen.created,
            "usage": gen.usage().model_dump(),
            "prompt_logprobs": _prompt_logprobs(gen), "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(gen.prompts[0].token_ids) if req.return_token_ids else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "output_mode": req.output_mode, "choices": choices}


def _prompt_logprobs(gen: Generation) -> list[dict[str, Any] | None] | None:
    field = prompt_logprobs_field(gen.prompt_logprobs[0])
    if field is None:
        return None
    return [None if e is None else {str(t): lp.model_dump() for t, lp in e.items()} for e in field]


async def _stream(gen: Generation, req: GenerateRequest) -> AsyncIterator[str]:
    """vLLM's chunks: one per delta (the prompt's ids in the first, where asked), then the
    usage chunk where `stream_options.include_usage`."""
    usage_at_end = bool(req.stream_options and req.stream_options.include_usage) or gen.ctx.force_include_usage
    continuous = usage_at_end and (bool(req.stream_options and req.stream_options.continuous_usage_stats)
                                   or gen.ctx.force_include_usage)
    prompt_ids = list(gen.prompts[0].token_ids) if req.return_token_ids else None
    num_prompt = len(gen.prompts[0].token_ids)
    delta: CompletionOutput
    async for index, delta in gen.deltas():
        if not (delta.token_ids or delta.finish_reason is not None or (req.output_mode == "text" and delta.text)):
            continue
        chunk: dict[str, Any] = {"request_id": gen.response_id, "output_mode": req.output_mode,
                                 "choices": [_choice(gen, req, index, delta.text, delta.token_ids,
                                                     delta.logprobs or [], delta.finish_reason,
                                                     delta.stop_reason)]}
        chunk["usage"] = None
        if continuous:
            done = len(gen.choices[index].token_ids)
            chunk["usage"] = UsageInfo(prompt_tokens=num_prompt, completion_tokens=done,
                                       total_tokens=num_prompt + done).model_dump()
        if prompt_ids is not None:
            chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
        yield json.dumps(chunk, ensure_ascii=False)
    if usage_at_end:
        yield json.dumps({"request_id": gen.response_id, "output_mode": req.output_mode, "choices": [],
                          "usage": gen.usage().model_dump(exclude_none=True)})


# ---- abort --------------------------------------------------------------------------------


async def abort_requests(ctx: ServerContext, raw: Request) -> Response:
    """vLLM's: `{"request_ids": [...]}`, the ids the responses carry; 200 at once."""
    try:
        body = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"JSON decode error: {e}") from e
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if ids is None:
        raise APIError(400, "Missing 'request_ids' in request body", "request_ids")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise APIError(400, "'request_ids' must be a list of request ids", "request_ids")
    for asked in ids:
        for engine_id in ctx.running.get(asked, [asked]):
            await ctx.engine.abort(engine_id)
    return Response(status_code=200)
