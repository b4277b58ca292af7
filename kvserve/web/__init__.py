"""The web page at `/` (kvserve serve and kvserve route): static files from the package.

Apart from the server and the gateway, which both install it (the gateway imports nothing of
the server). A chat that streams and a cache panel (kvserve/web/static/app.js says what it
shows and why it can only show text). The files are served as they are, with no build step; the page document
carries a Content Security Policy that allows scripts, styles and requests from this origin
only, no inline script or style, no plugins, no framing: even if a hostile prompt did reach the
DOM as markup, the browser would not run it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).with_name("static")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


class _StaticFiles(StaticFiles):
    async def get_response(self, path, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


PUBLIC_PATHS = ("/", "/ui/session")  # and /static/*: open even under --api-key-protect-all


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


def install_web(app: FastAPI, session: Callable[[Request], dict[str, Any]]) -> None:
    """GET / (the page), /static/* (its script and style) and GET /ui/session: what the page
    may show the key it was given (`session(request)`: key_required, key_accepted, admin,
    gateway), asked without a failing request, so the browser's console stays clean."""
    app.mount("/static", _StaticFiles(directory=WEB_DIR), name="static")

    @app.get("/ui/session", include_in_schema=False)
    async def ui_session(request: Request) -> dict[str, Any]:
        return session(request)

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html",
                            headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})
