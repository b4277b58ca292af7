"""The FastAPI application: routes, OpenAI-shaped errors, API-key check, lifespan.

Every failure a request can cause ends as `{"error": {"message", "type", "param", "code"}}`:
FastAPI's 422 for a body that does not validate becomes a 400, unknown routes 404/405, anything
unexpected a 500 for that request only.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from kvserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                     error_body)
from kvserve.server.serving import OpenAIServing

logger = logging.getLogger("kvserve")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (OpenAI error JSON)"},
    401: {"description": "Missing or wrong API key"},
    404: {"description": "Unknown model"},
    429: {"description": "Too many waiting requests"},
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per offending field (a union reports one error per variant: keep the first)."""
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
    by_field: dict[str, tuple[str, int]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else ""
        if field not in by_field:
            where = ".".join(loc)
            msg = err.get("msg", "invalid value")
            by_field[field] = (f"{where}: {msg}" if where else msg, 1)
        else:
            by_field[field] = (by_field[field][0], by_field[field][1] + 1)
    parts = []
    for field, (msg, count) in list(by_field.items())[:5]:
        parts.append(msg if count == 1 else f"{msg} (and {count - 1} more errors on {field!r})")
    if len(by_field) > 5:
        parts.append(f"... and {len(by_field) - 5} more fields")
    param = next((f for f in by_field if f), None)
    return "; ".join(parts) or "invalid request", param


class APIKeyMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would wrap `receive` and break the disconnect
    detection): `Authorization: Bearer KEY` on /v1/* and /reset_prefix_cache."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            if path.startswith("/v1") or path == "/reset_prefix_cache":
                given = b""
                for name, value in scope.get("headers", ()):
                    if name.lower() == b"authorization":
                        given = value
                        break
                if not hmac.compare_digest(given, self._expected):
                    response = JSONResponse(
                        error_body(401, "Invalid API key: pass it as 'Authorization: Bearer "
                                   "<key>'", code="invalid_api_key"), status_code=401)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: Sequence[str],
              api_key: str | None = None,
              metrics: PrometheusStatLogger | None = None) -> FastAPI:
    served_model_names = list(served_model_names)
    if metrics is None:
        metrics = PrometheusStatLogger(served_model_names[0])
    if metrics not in engine.stat_loggers:
        engine.stat_loggers.append(metrics)
    serving = OpenAIServing(engine, served_model_names)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_started:
            engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of the kvserve inference engine")
    app.state.engine = engine
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # -- errors -----------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_body(exc.status_code, detail), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path,
                     exc_info=exc)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    # -- routes -----------------------------------------------------------------------------
    @app.get("/health", responses={503: {"description": "The engine loop is not running"}})
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the engine loop is not running"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("kvserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
             "root": engine.config.model, "parent": None,
             "max_model_len": engine.max_model_len} for name in served_model_names]}

    @app.post("/reset_prefix_cache", responses=_ERROR_RESPONSES)
    async def reset_prefix_cache() -> Response:
        try:
            await engine.reset_prefix_cache()
        except Exception as exc:
            from kvserve.server.serving import engine_error

            raise engine_error(exc) from exc
        return Response(status_code=200)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await serving.create_completion(body, raw_request)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await serving.create_chat_completion(body, raw_request)

    return app
