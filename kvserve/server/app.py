"""The FastAPI application: routes, OpenAI-shaped errors, API-key check, lifespan.

Every failure a request can cause ends as `{"error": {"message", "type", "param", "code"}}`:
FastAPI's 422 for a body that does not validate becomes a 400, a body over the size limit a 413,
unknown routes 404/405, anything unexpected a 500 for that request only.

Request bodies are parsed by pydantic-core's JSON parser rather than `json.loads`: it is several
times faster (a 20 MB body holds the event loop, and so /health, for milliseconds rather than a
large fraction of a second) and it refuses lone surrogates ("\ud800"), so no string that cannot
be encoded as UTF-8 reaches a handler or the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.kv_events import KVEventPublisher
from kvserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from kvserve.server import serving_pins
from kvserve.frontend.anthropic_errors import anthropic_error, is_anthropic_path
from kvserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest, shaped_error
from kvserve.server.auth import AccessPolicy, AuthMiddleware, caller_of
from kvserve.server.protocol import (APIError, CacheExplainRequest, CachePinRequest,
                                     ChatCompletionRequest,
                                     CompletionRequest,
                                     error_body)
from kvserve.server.serving_chat import OpenAIServingChat
from kvserve.server.serving_messages import MessagesServing
from kvserve.web import install_web
from kvserve.utils.validation import DEFAULT_MAX_REQUEST_BODY_BYTES

logger = logging.getLogger("kvserve")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (OpenAI error JSON)"},
    401: {"description": "Missing or wrong API key"},
    403: {"description": "An admin endpoint, and the key is not an admin key"},
    404: {"description": "Unknown model"},
    413: {"description": "Request body over --max-request-body-bytes"},
    429: {"description": "Too many waiting requests"},
}


def _json_error_message(err: dict[str, Any]) -> str:
    detail = str((err.get("ctx") or {}).get("error", ""))
    message = "the request body is not valid JSON"
    if "surrogate" in detail or "hex escape" in detail:
        message += " (strings must be valid Unicode: a lone surrogate such as \\ud800 is not)"
    return f"{message}: {detail}" if detail else message


def _is_union_tag(part: object) -> bool:
    """pydantic names the variant of a union in `loc` ("list[constrained-int]"); field names
    never look like that."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in ("str", "int"))


# An unknown field is refused (OpenAI's behaviour) rather than ignored (vLLM's): protocol.py.
UNKNOWN_FIELD_MESSAGE = "unknown field: kvserve does not implement it, and refuses the " \
    "fields it does not implement rather than ignoring them"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per offending field. A union reports one error per variant; the one kept is the
    first that is not a plain type mismatch, since it says what is wrong with a value of the
    right type ("at most 16 items", ">= 0") where the first would say "not a string"."""
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return _json_error_message(err), None
    grouped: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        grouped.setdefault(loc[0] if loc else "", []).append(err)
    by_field: dict[str, tuple[str, int]] = {}
    for field, errs in grouped.items():
        best = next((e for e in errs if not str(e.get("type", "")).endswith("_type")), errs[0])
        where = ".".join(str(x) for x in best.get("loc", ())
                         if x != "body" and not _is_union_tag(x))
        msg = best.get("msg", "invalid value")
        if best.get("type") == "extra_forbidden":
            msg = UNKNOWN_FIELD_MESSAGE
        by_field[field] = (f"{where}: {msg}" if where else msg, len(errs))
    parts = []
    for field, (msg, count) in list(by_field.items())[:5]:
        parts.append(msg if count == 1 else f"{msg} (and {count - 1} more errors on {field!r})")
    if len(by_field) > 5:
        parts.append(f"... and {len(by_field) - 5} more fields")
    param = next((f for f in by_field if f), None)
    return "; ".join(parts) or "invalid request", param


_PARSE_INLINE_BYTES = 1 << 20  # larger bodies are parsed in a worker thread


class _JSONRequest(Request):
    """A request whose JSON body is parsed by pydantic-core (see the module docstring), in a
    worker thread when it is large. Large bodies are what a /health probe must not wait for:
    the body is copied into one buffer chunk by chunk as it arrives (sized by Content-Length)
    instead of being joined at the end, and the parse leaves the event loop free to run
    between its steps."""

    async def body(self) -> bytearray:
        if not hasattr(self, "_body"):
            buf = bytearray(_content_length(self.scope))  # checked by BodySizeLimitMiddleware
            end = 0
            async for chunk in self.stream():
                start, end = end, end + len(chunk)
                buf[start:end] = chunk
            del buf[end:]
            self._body = buf
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                if len(body) > _PARSE_INLINE_BYTES:
                    self._json = await asyncio.to_thread(from_json, body)
                else:
                    self._json = from_json(body)
            except ValueError as exc:  # FastAPI turns this one into its json_invalid error
                raise json.JSONDecodeError(str(exc), "", 0) from None
        return self._json


class _JSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def parse_with_pydantic_core(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return parse_with_pydantic_core


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, answered at once: by its Content-Length before
    any of the body is read, or (a chunked upload) as soon as the bytes received pass the limit,
    the rest never reaching the app. Either way /health is not kept waiting: the app neither
    reads nor parses such a body.

    The answer goes out whole as soon as it is known, with `Connection: close`; what the client
    still sends is then read and dropped, up to `_DRAIN_LIMIT` bytes or `_DRAIN_SECONDS` (a
    lingering close, as nginx does), before the connection closes. Closing with the upload
    still arriving would reset the connection, and a client that reads only after sending its
    whole body (httpx, requests) would see the reset rather than the 413."""

    _DRAIN_LIMIT = 256 * 1024**2
    _DRAIN_SECONDS = 30.0

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes:,} bytes " \
            "(--max-request-body-bytes)"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            await self._refuse(JSONResponse(shaped_error(scope.get("path", ""), 413,
                                                         self._message()), status_code=413),
                               receive, send)
            return
        received = 0
        more_body = True

        async def counting_receive():
            nonlocal received, more_body
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more_body = message.get("more_body", False)
                if received > self.max_bytes:  # FastAPI re-raises it; our handler answers
                    raise StarletteHTTPException(413, self._message())
            return message

        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def refusing_send(message) -> None:
            """The handler's 413 for an overflow goes out as `_refuse` sends one."""
            nonlocal start
            if received <= self.max_bytes:
                await send(message)
            elif message["type"] == "http.response.start":
                start = message
            else:
                chunks.append(bytes(message.get("body", b"")))
                if start is not None and not message.get("more_body", False):
                    await self._send_then_drain(start, b"".join(chunks), receive, send,
                                                more_body)

        await self.app(scope, counting_receive, refusing_send)

    async def _refuse(self, response: Response, receive, send) -> None:
        start = {"type": "http.response.start", "status": response.status_code,
                 "headers": response.raw_headers}
        await self._send_then_drain(start, response.body, receive, send, more_body=True)

    async def _send_then_drain(self, start: dict[str, Any], body: bytes, receive, send,
                               more_body: bool) -> None:
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"connection"]
        await send({**start, "headers": headers + [(b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._DRAIN_SECONDS
        drained = 0
        while more_body and drained < self._DRAIN_LIMIT:  # the client's bytes, dropped
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                break
            drained += len(message.get("body", b""))
            more_body = message["type"] == "http.request" and message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def build_app(engine: AsyncLLMEngine, served_model_names: Sequence[str],
              access: AccessPolicy | None = None,
              metrics: PrometheusStatLogger | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              request_log: str | None = None) -> FastAPI:
    """`access`: keys, roles and isolation (server/auth.py); default: no key, and nobody the
    admin (`AccessPolicy(admin_open=True)` makes every caller the admin)."""
    served_model_names = list(served_model_names)
    access = access or AccessPolicy()
    if metrics is None:
        metrics = PrometheusStatLogger(served_model_names[0])
    engine.add_stat_logger(metrics)
    kv_events = next((sl for sl in engine.stat_loggers if isinstance(sl, KVEventPublisher)),
                     None)
    if kv_events is None:
        kv_events = KVEventPublisher()
        engine.add_stat_logger(kv_events)
    serving = OpenAIServingChat(engine, served_model_names, access)
    messages = MessagesServing(serving)
    if request_log is not None:
        from kvserve.server.request_log import RequestLog

        serving.request_log = RequestLog(request_log, {
            "model": served_model_names[0], "block_size": engine.block_size,
            "pool_blocks": engine.num_kv_blocks, "eviction_policy": engine.config.eviction_policy,
            "prefix_caching": engine.config.enable_prefix_caching})
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_started:
            engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            if serving.request_log is not None:
                serving.request_log.close()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of the kvserve inference engine")
    app.router.route_class = _JSONRoute
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.access = access
    app.add_middleware(AuthMiddleware, policy=access)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)

    # -- errors -----------------------------------------------------------------------------
    # OpenAI's shape, or Anthropic's on /v1/messages (anthropic_protocol.shaped_error)
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if is_anthropic_path(request.url.path):
            return JSONResponse(anthropic_error(exc.status, exc.message), status_code=exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(shaped_error(request.url.path, 400, message, param=param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(shaped_error(request.url.path, exc.status_code, detail),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path,
                     exc_info=exc)
        return JSONResponse(shaped_error(request.url.path, 500,
                                         f"internal error: {type(exc).__name__}"),
                            status_code=500)

    # -- routes -----------------------------------------------------------------------------
    install_web(app, lambda request: access.session(caller_of(request)))

    @app.get("/health", responses={503: {"description": "The engine loop is not running"}})
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the engine loop is not running"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics", response_class=Response)
    async def get_metrics(request: Request) -> Response:
        return Response(metrics.render(per_tenant=caller_of(request).admin),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("kvserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "root": engine.config.model, "parent": None,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in served_model_names]}

    @app.get("/v1/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """OpenAI's model retrieval (`client.models.retrieve`); 404 model_not_found for a
        name this server does not serve. `:path`, since served names may hold a '/'."""
        return model_card(serving.check_model(model_id))

    @app.get("/v1/kv_events", responses=_ERROR_RESPONSES)
    async def get_kv_events(since: int = -1, timeout: float = 0.0) -> dict[str, Any]:
        """Blocks stored in / removed from this replica's prefix cache after event `since`
        (vLLM's BlockStored / BlockRemoved / AllBlocksCleared), waiting up to `timeout`
        seconds (at most 30) for one: what `kvserve route` subscribes to. Admin only: the
        hashes of everyone's blocks tell whoever can hash a guess whether it was sent."""
        return await kv_events.poll(since, min(max(timeout, 0.0), 30.0))

    @app.post("/reset_prefix_cache", responses=_ERROR_RESPONSES)
    async def reset_prefix_cache() -> Response:
        """Empty every tenant's prefix cache (admin only: server/auth.py)."""
        try:
            await engine.reset_prefix_cache()
        except Exception as exc:
            from kvserve.server.serving import engine_error

            raise engine_error(exc) from exc
        if serving.request_log is not None:  # a replay of the log must empty its cache here
            serving.request_log.write({"event": "reset_prefix_cache", "time": time.time()})
        return Response(status_code=200)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await serving.create_completion(body, raw_request)

    @app.post("/v1/cache/explain", responses=_ERROR_RESPONSES)
    async def explain_cache(body: CacheExplainRequest, raw_request: Request) -> dict[str, Any]:
        return await serving.explain_cache(body, caller_of(raw_request))

    @app.post("/v1/cache/pin", responses=_ERROR_RESPONSES)
    async def pin_cache(body: CachePinRequest, raw_request: Request) -> dict[str, Any]:
        return await serving_pins.create_pin(serving, body, caller_of(raw_request))

    @app.delete("/v1/cache/pin/{pin_id}", responses=_ERROR_RESPONSES)
    async def unpin_cache(pin_id: str, raw_request: Request) -> dict[str, Any]:
        return await serving_pins.delete_pin(serving, pin_id, caller_of(raw_request))

    @app.get("/v1/cache/tree", responses=_ERROR_RESPONSES)
    async def cache_tree(limit: int = 64) -> dict[str, Any]:
        """The largest shared prefixes, their size, hits and age (kv/tree_view.py; admin
        only: it shows what the cache holds)."""
        return await engine.prefix_tree(min(max(limit, 1), 512))

    @app.get("/v1/cache/pins", responses=_ERROR_RESPONSES)
    async def list_cache_pins(raw_request: Request) -> dict[str, Any]:
        return await serving_pins.list_pins(serving, caller_of(raw_request))

    @app.post("/v1/messages", responses=_ERROR_RESPONSES)
    async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
        """Anthropic's Messages API (server/serving_messages.py)."""
        return await messages.create(body, raw_request)

    @app.post("/v1/messages/count_tokens", responses=_ERROR_RESPONSES)
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return await messages.count_tokens(body)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await serving.create_chat_completion(body, raw_request)

    return app
