"""The built-in web page: a streaming chat and a live panel of the server's own stats.

`router.py` owns the routes: the page and its assets (`/`, `/ui/*`, served before the API-key
gate because they carry no data) and `GET /stats` (the live figures, behind the gate like
every API route). `static/` holds the page: plain HTML, CSS and JavaScript, no build step.
"""

from pagoda.server.webui.router import STATIC_DIR, WebUIAssets, router

__all__ = ["STATIC_DIR", "WebUIAssets", "router"]
