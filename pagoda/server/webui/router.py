"""Routes of the web page: its static assets, and `GET /stats` for its live panel.

The page (`/`) and its files (`/ui/<file>`) are answered by `WebUIAssets`, an ASGI layer
outside the gate middleware: they are the same for everyone and carry no data, so a browser
can load them before it knows the API key. Everything the page shows comes from API routes
behind the gate (`/v1/models`, `/v1/chat/completions`, `/stats`), to which the page sends the
key it asks for. `--disable-web-ui` leaves the layer out, and `/` is a 404 again.

`GET /stats` answers the `LiveStatLogger` snapshot (see `pagoda/metrics/live.py`) with the
model's name; it is served whether or not the page is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import get_route_path
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.server.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSET_PREFIX = "/ui/"
# NOTE: everything the page loads comes from this server; no CDN, no inline script.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "style-src 'self'; script-src 'self'; connect-src 'self'",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter()


@router.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    """The live panel's figures: running/waiting requests, KV usage, tok/s, percentiles."""
    live = getattr(request.app.state, "live_stats", None)
    if live is None:
        raise APIError(404, "This server records no live stats.")
    ctx = request.app.state.ctx
    return {"model": ctx.model_name, "max_model_len": ctx.max_model_len, **live.snapshot()}


class WebUIAssets:
    """Answers GET/HEAD for the page and its assets; passes every other request on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.files = StaticFiles(directory=STATIC_DIR)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._response(scope) if scope["type"] == "http" else None
        if response is None:
            await self.app(scope, receive, send)
        else:
            await response(scope, receive, send)

    async def _response(self, scope: Scope) -> Response | None:
        if scope["method"] not in ("GET", "HEAD"):
            return None
        path = get_route_path(scope)
        if path == "/":
            return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)
        if not path.startswith(ASSET_PREFIX):
            return None
        try:
            response = await self.files.get_response(path[len(ASSET_PREFIX):], scope)
        except HTTPException as e:
            return PlainTextResponse(str(e.detail), status_code=e.status_code)
        response.headers.update(PAGE_HEADERS)
        return response
