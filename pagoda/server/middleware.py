"""The gate every HTTP request passes: drain (503), API keys (401), body size (413),
in-flight count.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would wrap
`receive` and so hide a client's disconnect from the routes that watch for it. With a key set,
every route needs it except the probes and the scrape target (`OPEN_ROUTES`). A body larger
than `max_request_body_bytes` is refused from its Content-Length, or, when chunked, as soon
as that many bytes have arrived, so no route ever parses it.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.responses import JSONResponse
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.server.errors import error_body
from pagoda.server.serving import ServerContext

# NOTE: while draining, a load balancer still needs /metrics (and an operator /kv_cache);
# /health answers 503 on purpose.
OPEN_WHILE_DRAINING = ("/metrics", "/kv_cache", "/load")
# NOTE: what load balancers, supervisors and Prometheus call without credentials.
OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")
# NOTE: the routes that run the model, which `GET /load` counts (vLLM's load-aware routes).
LOAD_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/pooling", "/classify",
               "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


def counts_as_load(path: str) -> bool:
    return path in LOAD_ROUTES or path.startswith("/v1/responses")


def key_matches(given: str, keys: list[str]) -> bool:
    """Whether `given` is one of `keys`, in time independent of where they differ."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given.encode(), key.encode())
    return matched


def _bearer_token(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class GateMiddleware:
    """Refuses requests while draining or without a valid key; counts the ones it admits."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            receive, refusal = await self._bounded_body(scope, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        load = int(self.ctx.enable_server_load_tracking and counts_as_load(get_route_path(scope)))
        self.ctx.num_active_requests += 1
        self.ctx.server_load += load
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctx.num_active_requests -= 1
            self.ctx.server_load -= load

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        path = get_route_path(scope)  # NOTE: without --root-path's prefix, where the request has it
        if self.ctx.draining and path not in OPEN_WHILE_DRAINING:
            body = error_body(503, "The server is shutting down and accepts no new requests.")
            return JSONResponse(body, status_code=503, headers={"Connection": "close"})
        if self.ctx.api_keys and path not in OPEN_ROUTES:
            if not key_matches(_bearer_token(scope), self.ctx.api_keys):
                body = error_body(401, "Incorrect or missing API key.", code="invalid_api_key")
                return JSONResponse(body, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        length = _content_length(scope)
        if length is not None and length > self.ctx.max_request_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> JSONResponse:
        limit = self.ctx.max_request_body_bytes
        body = error_body(413, f"The request body is larger than this server accepts ({limit} "
                               "bytes, --max-request-body-bytes).")
        return JSONResponse(body, status_code=413, headers={"Connection": "close"})

    async def _bounded_body(self, scope: Scope, receive: Receive
                            ) -> tuple[Receive, JSONResponse | None]:
        """For a body without Content-Length: reads it up to the limit, then replays it."""
        if _content_length(scope) is not None or scope["method"] in ("GET", "HEAD"):
            return receive, None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return receive, None  # NOTE: a disconnect; the route sees it on its own read.
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.ctx.max_request_body_bytes:
                return receive, self._too_large()
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return replay, None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestIdHeaders:
    """vLLM's `--enable-request-id-headers`: every HTTP response carries `X-Request-Id`, the
    request's own when it sent one, else a new random id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """vLLM's --root-path (FastAPI's root_path, set on the app as vLLM sets it): a request's
    path may carry the prefix a proxy serves the app under, or not; the routes and the gate
    read it without (`get_route_path`)."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
