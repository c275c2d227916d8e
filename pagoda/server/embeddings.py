"""The pooling routes: `/v1/embeddings`, `/pooling`, `/score` and `/rerank` (vLLM's shapes).

Each input becomes one pooled engine request (pooling.py) through `Generation.create_pooled`,
so the limits, the queue's 429, fairness between users and aborts on disconnect are those of
the generation routes. Score and rerank embed both sides and answer the cosine similarity of
the embeddings (vLLM's scoring for embedding models); rerank sorts by it, best first.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import Any

import torch
from fastapi import Request
from starlette.responses import JSONResponse, Response

from pagoda.pooling import PoolingParams
from pagoda.server.constraints import check_supported
from pagoda.server.errors import bad_request
from pagoda.server.pooling_protocol import (
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingFields,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from pagoda.server.protocol import UsageInfo, now, random_id
from pagoda.server.serving import Generation, Prompt, ServerContext, tokenize_text
from pagoda.server.streaming import until_disconnect


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the client asked: floats, or OpenAI's base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def input_prompts(ctx: ServerContext, items: EmbeddingInput, add_special_tokens: bool,
                        param: str = "input") -> list[Prompt]:
    """`input` as prompts: a string, strings, token ids, or lists of token ids (400 if empty)."""
    if isinstance(items, str):
        items = [items]
    if not items:
        raise bad_request(f"`{param}` cannot be empty.", param)
    if isinstance(items[0], int):
        return [Prompt(list(items))]  # type: ignore[arg-type]
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request(f"`{param}` cannot hold an empty string.", param)
            prompts.append(Prompt(await tokenize_text(ctx, item, add_special_tokens, param), item))
        else:
            prompts.append(Prompt(list(item)))  # type: ignore[arg-type]
    return prompts


def pooling_params(ctx: ServerContext, req: PoolingFields, **fields: Any) -> PoolingParams:
    """The request's `PoolingParams`; 400s for what the engine cannot take."""
    check_supported(req)
    keep = req.truncate_prompt_tokens
    if keep is not None and keep > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                          f"({ctx.max_model_len}). Please request a smaller truncation size.",
                          "truncate_prompt_tokens")
    try:
        return PoolingParams(truncate_prompt_tokens=keep, **fields)
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from e


async def pool(ctx: ServerContext, raw: Request, prefix: str, prompts: list[Prompt],
               params: PoolingParams, req: PoolingFields) -> tuple[str, Generation] | None:
    """Runs the prompts' pooled requests; None if the client went away."""
    request_id = random_id(prefix)
    gen = await Generation.create_pooled(ctx, request_id, prompts, params, req.priority, req.user)
    if await until_disconnect(raw, gen.run()) is None:
        return None
    return request_id, gen


def usage(gen: Generation) -> UsageInfo:
    num_prompt = sum(len(r.prompt_token_ids) for r in gen.requests)
    return UsageInfo(prompt_tokens=num_prompt, total_tokens=num_prompt)


def vectors(gen: Generation) -> list[list[float]]:
    return [v or [] for v in gen.pooled]


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest, raw: Request) -> Response:
    return await _pooled_vectors(ctx, req, raw, "embd", EmbeddingResponse,
                                 lambda i, v: EmbeddingResponseData(index=i, embedding=v))


async def create_pooling(ctx: ServerContext, req: PoolingRequest, raw: Request) -> Response:
    return await _pooled_vectors(ctx, req, raw, "pool", PoolingResponse,
                                 lambda i, v: PoolingResponseData(index=i, data=v), task=req.task)


async def _pooled_vectors(ctx: ServerContext, req: EmbeddingRequest, raw: Request, prefix: str,
                          response_type: type[EmbeddingResponse] | type[PoolingResponse],
                          item: Callable[[int, list[float] | str], Any], **fields: Any) -> Response:
    """One vector per input, each encoded as asked, in the response type's list."""
    ctx.check_model(req.model)
    params = pooling_params(ctx, req, dimensions=req.dimensions, pooling_type=req.pooling_type,
                            normalize=True if req.normalize is None else req.normalize, **fields)
    prompts = await input_prompts(ctx, req.input, req.add_special_tokens)
    done = await pool(ctx, raw, prefix, prompts, params, req)
    if done is None:
        return Response(status_code=499)
    request_id, gen = done
    data = [item(i, encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors(gen))]
    return JSONResponse(response_type(id=request_id, created=now(), model=req.model or ctx.model_name,
                                      data=data, usage=usage(gen)).model_dump(exclude_none=True))


def cosine(a: list[float], b: list[float]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


async def embed_pairs(ctx: ServerContext, raw: Request, req: PoolingFields, prefix: str,
                      firsts: list[str], seconds: list[str], names: tuple[str, str]
                      ) -> tuple[str, list[float], Generation] | None:
    """The cosine of each (first, second) pair's embeddings (one first: against every second);
    None if the client went away. `names`: the two fields, for the 400s."""
    if not firsts or not seconds:
        raise bad_request(f"`{names[0] if not firsts else names[1]}` cannot be empty.",
                          names[0] if not firsts else names[1])
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N, got "
                          f"{len(firsts)}:{len(seconds)}.", names[0])
    params = pooling_params(ctx, req)
    prompts = await input_prompts(ctx, firsts + seconds, req.add_special_tokens)
    done = await pool(ctx, raw, prefix, prompts, params, req)
    if done is None:
        return None
    request_id, gen = done
    embedded = vectors(gen)
    lefts, rights = embedded[:len(firsts)], embedded[len(firsts):]
    lefts = lefts * len(rights) if len(lefts) == 1 else lefts
    return request_id, [cosine(a, b) for a, b in zip(lefts, rights, strict=True)], gen


async def create_score(ctx: ServerContext, req: ScoreRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    done = await embed_pairs(ctx, raw, req, "score", firsts, seconds, ("text_1", "text_2"))
    if done is None:
        return Response(status_code=499)
    request_id, scores, gen = done
    data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
    return JSONResponse(ScoreResponse(id=request_id, created=now(), model=req.model or ctx.model_name,
                                      data=data, usage=usage(gen)).model_dump(exclude_none=True))


async def create_rerank(ctx: ServerContext, req: RerankRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    done = await embed_pairs(ctx, raw, req, "rerank", [req.query], req.documents,
                             ("query", "documents"))
    if done is None:
        return Response(status_code=499)
    request_id, scores, gen = done
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
    results = [RerankResult(index=i, document=RerankDocument(text=req.documents[i]),
                            relevance_score=scores[i]) for i in ranked]
    return JSONResponse(RerankResponse(id=request_id, model=req.model or ctx.model_name,
                                       usage=RerankUsage(total_tokens=usage(gen).total_tokens),
                                       results=results).model_dump())
