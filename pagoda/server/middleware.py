"""The gate every HTTP request passes: drain (503), API keys (401), in-flight count.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would wrap
`receive` and so hide a client's disconnect from the routes that watch for it.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.server.errors import error_body
from pagoda.server.serving import ServerContext

# NOTE: while draining, a load balancer still needs /metrics (and an operator /kv_cache);
# /health answers 503 on purpose.
OPEN_WHILE_DRAINING = ("/metrics", "/kv_cache")


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
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        self.ctx.num_active_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctx.num_active_requests -= 1

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        path: str = scope["path"]
        if self.ctx.draining and path not in OPEN_WHILE_DRAINING:
            body = error_body(503, "The server is shutting down and accepts no new requests.")
            return JSONResponse(body, status_code=503, headers={"Connection": "close"})
        if self.ctx.api_keys and path.startswith("/v1"):
            if not key_matches(_bearer_token(scope), self.ctx.api_keys):
                body = error_body(401, "Incorrect or missing API key.", code="invalid_api_key")
                return JSONResponse(body, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return None
