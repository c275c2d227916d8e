"""The FastAPI app: OpenAI routes (/v1/...) and vLLM's side routes.

Routes are thin: they validate, then hand off to `completions.py` / `chat.py` /
`responses.py` / `embeddings.py` (embeddings, pooling, score, rerank). Every error leaves in the OpenAI shape (`errors.py`); the gate middleware
handles keys and draining.
`/invocations` (SageMaker) routes a body to chat, completions, responses, embeddings, pooling,
score or rerank by its shape.
The engine runs in its own thread, so these handlers only wait on it and /health or
/v1/models answer at once even when it is saturated. /health answers 503 with the reason when
the engine loop died or stalls; /kv_cache reports the KV pool (bytes, blocks, tokens held,
slots reserved, and what contiguous reservation would need). The web page (`/`) and its live
stats route (`/stats`) live in `webui/`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from pagoda.lora import LoRARequest
from pagoda.metrics import LiveStatLogger, format_kv_memory_report, render_metrics
from pagoda.server.chat import create_chat_completion, render_chat
from pagoda.server.chat_batch import BatchChatCompletionRequest, create_batch_chat_completion
from pagoda.server.completions import create_completion
from pagoda.server.embeddings import create_embedding, create_pooling, create_rerank, create_score
from pagoda.server.errors import APIError, bad_request, error_response, install_error_handlers
from pagoda.server.messages import count_tokens, create_messages
from pagoda.server.messages_protocol import AnthropicMessagesRequest
from pagoda.server.middleware import GateMiddleware, RequestIdHeaders, RootPath
from pagoda.server.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.server.responses import cancel_response, create_response, retrieve_response
from pagoda.server.responses_protocol import ResponsesRequest
from pagoda.server.serving import ServerContext, invalid_input, tokenize_text
from pagoda.server.tokens import (
    abort_requests,
    check_enabled,
    generate,
    render_chat_request,
    render_completion_request,
    render_messages_request,
    render_responses_request,
)
from pagoda.server.tokens_protocol import GenerateRequest
from pagoda.server.webui import WebUIAssets
from pagoda.server.webui import router as webui_router


def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


async def require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed")


Ctx = Annotated[ServerContext, Depends(get_ctx)]
JSON_BODY = [Depends(require_json)]


async def require_scale_out(request: Request) -> None:
    """vLLM's 403 without --enable-scale-out, before the body is read (as vLLM's)."""
    check_enabled(request.app.state.ctx)


SCALE_OUT = [Depends(require_scale_out), *JSON_BODY]
router = APIRouter()
# NOTE: vLLM's runtime adapter routes, served only when asked for (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
lora_router = APIRouter()
# NOTE: vLLM's older abort path, served with --tokens-only only (as vLLM; behind the API keys here)
tokens_only_router = APIRouter()
# NOTE: vLLM's /tokenizer_info, served with --enable-tokenizer-info-endpoint only
tokenizer_info_router = APIRouter()


def pagoda_version() -> str:
    try:
        return importlib.metadata.version("pagoda")
    except importlib.metadata.PackageNotFoundError:
        import pagoda

        return str(getattr(pagoda, "__version__", "0.1.0"))


@router.get("/health")
async def health(ctx: Ctx) -> Response:
    healthy, message = ctx.engine.check_health()
    if not healthy:
        return error_response(APIError(503, f"The engine is not healthy: {message}"))
    return Response(status_code=200)


@router.get("/load")
async def load(ctx: Ctx) -> JSONResponse:
    """vLLM's server load: the calls running the model now (0 without
    `--enable-server-load-tracking`)."""
    return JSONResponse({"server_load": ctx.server_load})


@router.get("/ping")
async def ping(ctx: Ctx) -> Response:
    return await health(ctx)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": pagoda_version()}


@router.get("/v1/models")
async def list_models(ctx: Ctx) -> ModelList:
    return ModelList(data=[ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                           for name in ctx.served_model_names]
                     + [ModelCard(id=name, root=lora.lora_path, parent=ctx.model_name,
                                  max_model_len=ctx.max_model_len)
                        for name, lora in ctx.lora_requests.items()])


@router.post("/v1/completions", dependencies=JSON_BODY)
async def completions(req: CompletionRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_completion(ctx, req, raw)


@router.post("/v1/chat/completions", dependencies=JSON_BODY)
async def chat_completions(req: ChatCompletionRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_chat_completion(ctx, req, raw)


@router.post("/v1/chat/completions/batch", dependencies=JSON_BODY)
async def batch_chat_completions(req: BatchChatCompletionRequest, raw: Request, ctx: Ctx) -> Response:
    """vLLM's: several conversations in one request, choice i for conversation i."""
    return await create_batch_chat_completion(ctx, req, raw)


@router.post("/v1/completions/render", dependencies=SCALE_OUT)
async def completions_render(req: CompletionRequest, raw: Request, ctx: Ctx) -> Response:
    """vLLM's: the prompts' `/inference/v1/generate` requests, one per prompt; nothing runs."""
    return await render_completion_request(ctx, req, raw)


@router.post("/v1/chat/completions/render", dependencies=SCALE_OUT)
async def chat_completions_render(req: ChatCompletionRequest, raw: Request, ctx: Ctx) -> Response:
    """vLLM's: the conversation's `/inference/v1/generate` request; nothing runs."""
    return await render_chat_request(ctx, req, raw)


@router.post("/v1/messages", dependencies=JSON_BODY)
async def anthropic_messages(raw: Request, ctx: Ctx) -> Response:
    """Anthropic's Messages API on the chat path (vLLM's `/v1/messages`)."""
    return await create_messages(ctx, raw)


@router.post("/v1/messages/count_tokens", dependencies=JSON_BODY)
async def anthropic_count_tokens(raw: Request, ctx: Ctx) -> Response:
    """Anthropic's token count of a Messages request's prompt (vLLM's)."""
    return await count_tokens(ctx, raw)


@router.post("/v1/responses/render", dependencies=SCALE_OUT)
async def responses_render(req: ResponsesRequest, ctx: Ctx) -> Response:
    """vLLM's: the Responses request's `/inference/v1/generate` request; nothing runs."""
    return await render_responses_request(ctx, req)


@router.post("/v1/messages/render", dependencies=SCALE_OUT)
async def messages_render(req: AnthropicMessagesRequest, raw: Request, ctx: Ctx) -> Response:
    """vLLM's: the Anthropic Messages request's `/inference/v1/generate` request; nothing runs."""
    return await render_messages_request(ctx, req, raw)


@router.post("/inference/v1/generate", dependencies=SCALE_OUT)
async def inference_generate(req: GenerateRequest, raw: Request, ctx: Ctx) -> Response:
    """vLLM's token-in, token-out generation."""
    return await generate(ctx, req, raw)


@router.post("/inference/v1/abort_requests", dependencies=SCALE_OUT)
@tokens_only_router.post("/abort_requests", dependencies=SCALE_OUT)
async def inference_abort_requests(raw: Request, ctx: Ctx) -> Response:
    """vLLM's: aborts requests by their responses' ids."""
    return await abort_requests(ctx, raw)


@router.post("/v1/responses", dependencies=JSON_BODY)
async def responses(req: ResponsesRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_response(ctx, req, raw)


@router.post("/v1/embeddings", dependencies=JSON_BODY)
async def embeddings(req: EmbeddingRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_embedding(ctx, req, raw)


@router.post("/pooling", dependencies=JSON_BODY)
async def pooling(req: PoolingRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_pooling(ctx, req, raw)


@router.post("/score", dependencies=JSON_BODY)
@router.post("/v1/score", dependencies=JSON_BODY)
async def score(req: ScoreRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_score(ctx, req, raw)


@router.post("/rerank", dependencies=JSON_BODY)
@router.post("/v1/rerank", dependencies=JSON_BODY)
async def rerank(req: RerankRequest, raw: Request, ctx: Ctx) -> Response:
    return await create_rerank(ctx, req, raw)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, ctx: Ctx) -> dict[str, Any]:
    return retrieve_response(ctx, response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_responses(response_id: str, ctx: Ctx) -> dict[str, Any]:
    """OpenAI's: stops a background response that is still being generated."""
    return await cancel_response(ctx, response_id)


# NOTE: vLLM's /invocations tries each request type in this order; pagoda picks by the body's
# key, so a malformed body gets its own route's 400 rather than "no handler".
INVOCATION_ROUTES: tuple[tuple[str, Any, Any], ...] = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("text_1", ScoreRequest, create_score),
    ("query", RerankRequest, create_rerank),
    ("task", PoolingRequest, create_pooling),
    ("input", ResponsesRequest, create_response),
)
EMBEDDING_KEYS = ("encoding_format", "dimensions")


def invocation_route(body: Any) -> tuple[Any, Any]:
    """The request type and handler of an /invocations body: `input` is an embedding request
    when it is a list of strings or token ids, or beside `encoding_format` or `dimensions`;
    else (a string, or a list of items) a response."""
    if not isinstance(body, dict):
        raise bad_request("An /invocations body is a JSON object.")
    items = body.get("input")
    embedding = any(key in body for key in EMBEDDING_KEYS) or (
        isinstance(items, list) and not all(isinstance(item, dict) for item in items))
    if embedding and not any(key in body for key in ("messages", "prompt", "task")):
        return EmbeddingRequest, create_embedding
    for key, request_type, handler in INVOCATION_ROUTES:
        if key in body:
            return request_type, handler
    raise bad_request("Cannot find suitable handler for request: an /invocations body holds "
                      "`messages` (a chat completion), `prompt` (a completion), `input` (a "
                      "response, or embeddings), `text_1` (score), `query` (rerank) or `task` "
                      "with `input` (pooling).")


@router.post("/invocations", dependencies=JSON_BODY)
async def invocations(raw: Request, ctx: Ctx) -> Response:
    """SageMaker's one route: a body with `messages` is a chat completion, one with `prompt`
    a completion, one with `input` a response or embeddings (`invocation_route`), one with
    `text_1` a score, one with `query` a rerank."""
    try:
        body = await raw.json()
    except ValueError as e:
        raise bad_request(f"Malformed JSON body: {e}") from e
    request_type, handler = invocation_route(body)
    try:
        req = request_type.model_validate(body)
    except ValidationError as e:
        # NOTE: the same 400 a malformed body gets on the routes themselves.
        raise RequestValidationError(e.errors()) from e
    response: Response = await handler(ctx, req, raw)
    return response


@router.post("/tokenize", dependencies=JSON_BODY)
async def tokenize(req: TokenizeRequest, ctx: Ctx) -> TokenizeResponse:
    ctx.check_model(req.model)
    if req.messages is not None:
        text = await render_chat(ctx, req.messages, req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message)
        add_special, param = bool(req.add_special_tokens), "messages"
    elif req.prompt is not None:
        text = req.prompt
        add_special, param = req.add_special_tokens is not False, "prompt"
    else:
        raise bad_request("Either `prompt` or `messages` is required.", "prompt")
    token_ids = await tokenize_text(ctx, text, add_special, param)
    token_strs = ctx.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len,
                            tokens=token_ids, token_strs=token_strs)


@router.post("/detokenize", dependencies=JSON_BODY)
async def detokenize(req: DetokenizeRequest, ctx: Ctx) -> DetokenizeResponse:
    ctx.check_model(req.model)
    # NOTE: decoding costs about as much per token as tokenizing per character; one bound.
    if len(req.tokens) > ctx.processor.max_prompt_chars:
        raise bad_request(f"At most {ctx.processor.max_prompt_chars} tokens can be detokenized "
                          f"(--max-prompt-chars), got {len(req.tokens)}.", "tokens")
    try:
        if req.tokens:
            ctx.processor.check_token_ids(req.tokens, "tokens")
    except ValueError as e:
        raise invalid_input(e) from e
    text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens)
    return DetokenizeResponse(prompt=str(text))


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info(ctx: Ctx) -> dict[str, Any]:
    """vLLM's: the tokenizer's configuration (its init arguments, file paths left out), its
    class, and the server's --chat-template where one is given."""
    info = {k: _plain(v) for k, v in (getattr(ctx.tokenizer, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    info["tokenizer_class"] = type(ctx.tokenizer).__name__
    if ctx.chat_template:
        info["chat_template"] = ctx.chat_template
    return info


def _plain(value: Any) -> Any:
    """A JSON value of a tokenizer argument (an added token as its text, as vLLM's)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


@router.get("/metrics")
async def metrics() -> Response:
    body, content_type = render_metrics()
    return Response(content=body, media_type=content_type)


@router.get("/kv_cache")
async def kv_cache(ctx: Ctx) -> dict[str, Any]:
    """The KV pool report: `LLMEngine.kv_report()`'s numbers plus their wording in `text`."""
    report = ctx.engine.kv_report()
    return {**report, "text": format_kv_memory_report(report)}


@dataclass(frozen=True)
class CorsPolicy:
    """vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials."""

    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


@lora_router.post("/v1/load_lora_adapter", dependencies=JSON_BODY)
async def load_lora_adapter(req: LoadLoRAAdapterRequest, ctx: Ctx) -> Response:
    """Loads a PEFT folder and serves it under `lora_name` (vLLM's answers and errors)."""
    if not req.lora_name or not req.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if req.lora_name in ctx.served_model_names:
        raise bad_request(f"The lora adapter '{req.lora_name}' conflicts with a served base model.", "lora_name")
    previous = ctx.lora_requests.get(req.lora_name)
    if previous is not None and not req.load_inplace:
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to "
                          "load the adapter in place, set 'load_inplace' to True.", "lora_name")
    lora_id = previous.lora_int_id if previous is not None else \
        max((lora.lora_int_id for lora in ctx.lora_requests.values()), default=0) + 1
    lora = LoRARequest(req.lora_name, lora_id, req.lora_path)
    if previous is not None:
        await ctx.engine.remove_lora(lora_id)  # NOTE: in place: its new weights load below
    try:
        await ctx.engine.add_lora(lora)
    except (ValueError, OSError) as e:
        raise bad_request(str(e), "lora_path") from e
    ctx.lora_requests[req.lora_name] = lora
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


@lora_router.post("/v1/unload_lora_adapter", dependencies=JSON_BODY)
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, ctx: Ctx) -> Response:
    if not req.lora_name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    lora = ctx.lora_requests.pop(req.lora_name, None)
    if lora is None:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
    await ctx.engine.remove_lora(lora.lora_int_id)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")


def build_app(ctx: ServerContext, live_stats: LiveStatLogger | None = None,
              web_ui: bool = True, request_id_headers: bool = False, api_docs: bool = True,
              cors: CorsPolicy | None = None, log_error_stack: bool = False,
              runtime_lora: bool = False, root_path: str = "") -> FastAPI:
    """The app serving `ctx.engine`; `ctx` is shared with the launcher (draining, counts).

    Args:
        live_stats: the engine's live stat logger, read by `GET /stats` (404 without one).
        web_ui: serve the web page at `/` (`--disable-web-ui` turns it off).
        request_id_headers: every response carries `X-Request-Id` (vLLM's
            `--enable-request-id-headers`).
        api_docs: serve `/docs`, `/redoc` and `/openapi.json` (`--disable-fastapi-docs`: not).
        cors: answer browsers' cross-origin calls as the policy allows (outermost, so a
            preflight is answered before the API key is asked for); None, the default, sends no
            CORS headers (vLLM allows every origin unless told otherwise).
        runtime_lora: serve `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's
            VLLM_ALLOW_RUNTIME_LORA_UPDATING).
        root_path: the prefix a proxy serves the app under (`--root-path`), FastAPI's as vLLM
            sets it: each route answers with the prefix and without it.
    """
    app = FastAPI(title="pagoda", version=pagoda_version(),
                  description="OpenAI-compatible LLM server (vLLM-style).",
                  docs_url="/docs" if api_docs else None, redoc_url="/redoc" if api_docs else None,
                  openapi_url="/openapi.json" if api_docs else None)
    app.state.ctx = ctx
    app.state.live_stats = live_stats
    app.state.web_ui = web_ui
    install_error_handlers(app, log_stack=log_error_stack)
    app.add_middleware(GateMiddleware, ctx=ctx)
    if web_ui:
        # NOTE: added last, so outermost: the page's static files are answered before the gate.
        app.add_middleware(WebUIAssets)
    if request_id_headers:
        app.add_middleware(RequestIdHeaders)
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)
    app.include_router(router)
    if runtime_lora:
        app.include_router(lora_router)
    if ctx.tokens_only:
        app.include_router(tokens_only_router)
    if ctx.enable_tokenizer_info:
        app.include_router(tokenizer_info_router)
    app.include_router(webui_router)
    return app
