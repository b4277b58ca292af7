"""The gateway: an OpenAI-compatible FastAPI app that sends each request to one replica.

Per request: parse the body, compute its prefix key (keys.py), let the policy pick among the
available replicas (policies.py), forward the body unchanged over a pooled connection, and
pass the answer back — status code and body as the replica gave them, a stream chunk by chunk.

Failures, by when they happen:
- before the replica's first body byte (connection refused or reset, a 502/503/504, a stream
  that breaks before its first chunk, a non-streaming body cut short): nothing has reached the
  client, so the request is sent to another replica, each replica tried at most once; a replica
  that did not answer is taken out of the rotation until its health check passes again.
- after the first byte of a stream: the stream is ended with an OpenAI-shaped error event and
  `data: [DONE]`, so a client never hangs on a dead replica.

Backpressure: a stream is relayed by an async generator that reads the next upstream chunk only
when the previous one has been handed to the client, so a slow client slows the read from the
replica (and, through TCP, the replica) instead of filling the gateway's memory.

API keys (`--api-key`, `--api-key-file`): checked at the gateway (a missing or wrong key is a 401
there); the client's Authorization header goes on to the replicas unchanged, either way, so
that a replica tells its callers apart as it would without the gateway (its roles, and under
`--kv-isolation api_key` its namespaces, which the gateway's prefix keys follow: keys.py).
`--admin-api-key` is the gateway's own credential for what only a replica's admin may read:
the KV events it subscribes to (events.py).

The pieces are separate so that prefill/decode disaggregation (disagg.py) can route one request
in two hops with them: `send` (choose in a pool, retry, take the first byte) and `respond`
(hand the answer to the client).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.frontend.anthropic_errors import anthropic_error, is_anthropic_path
from kvserve.router.events import subscribe
from kvserve.router.keys import PrefixKeyer
from kvserve.router.metrics import CONTENT_TYPE, RouterMetrics
from kvserve.router.policies import NoReplicaAvailable, RoutingPolicy
from kvserve.router.replicas import ReplicaState, check_once, health_loop
from kvserve.web import install_web
from kvserve.frontend.tenancy import Credentials, client_key

logger = logging.getLogger("kvserve.router")

RETRY_STATUSES = frozenset({502, 503, 504})
_KEY_INLINE_BYTES = 64 * 1024  # larger bodies are keyed (parsed, tokenized) in a worker thread


def error_body(status: int, message: str, code: str | int | None = None,
               path: str = "") -> dict[str, Any]:
    """OpenAI's error object, or Anthropic's on /v1/messages (what that route's clients read)."""
    if is_anthropic_path(path):
        return anthropic_error(status, message)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None,
                      "code": code if code is not None else status}}


def error_event(message: str) -> bytes:
    """What ends a stream that broke mid-way: an OpenAI error object, then [DONE]."""
    return (f"data: {json.dumps(error_body(502, message))}\n\n" "data: [DONE]\n\n").encode()


@dataclass
class RouterConfig:
    credentials: Credentials = field(default_factory=Credentials)  # the clients' keys
    admin_api_key: str | None = None  # the replicas' admin key: their /v1/kv_events
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0  # the longest wait for any upstream read
    kv_events: bool = True
    max_connections: int = 1024
    max_request_body_bytes: int = 32 * 1024**2  # kvserve serve's default: 413 beyond
    prefill_timeout_s: float | None = None  # PD (disagg.py): a prefill read's longest wait


@dataclass
class Pool:
    """Replicas one policy chooses among for one role: the gateway's replicas, or in PD mode
    (disagg.py) its prefill or its decode instances, which never stand in for each other."""

    role: str
    replicas: list[ReplicaState]
    policy: RoutingPolicy
    # Whether routing history and KV events keep the replicas' prefix pictures: a pool chosen
    # blind to prefixes (PD's decode pool) would only spend memory on them.
    track_prefixes: bool = True


@dataclass
class Answer:
    """A replica's answer once it has begun, before it goes to the client: the whole body, or
    an open stream (`relay`, first chunk included). An open stream must be handed to a
    StreamingResponse at once: only iterating it to the end releases the replica's load and
    connection."""

    replica: ReplicaState
    status_code: int
    media_type: str | None
    content: bytes = b""
    relay: AsyncIterator[bytes] | None = None


@dataclass
class Keyed:
    """A request as a policy reads it."""

    block_hashes: list[int]


class _Candidate:
    """A replica as the policy sees it for one request: out if it failed this request."""

    __slots__ = ("replica", "tried")

    def __init__(self, replica: ReplicaState, tried: set[int]) -> None:
        self.replica = replica
        self.tried = tried

    @property
    def available(self) -> bool:
        return self.replica.healthy and self.replica.index not in self.tried

    @property
    def load(self) -> int:
        return self.replica.in_flight

    def match_tokens(self, request) -> int:
        return self.replica.match_tokens(request)

    @property
    def cached_blocks(self) -> int:
        return self.replica.cached_blocks


class _Attempt:
    """A request in flight on one replica: counts it in the replica's load until closed."""

    def __init__(self, replica: ReplicaState, metrics: RouterMetrics) -> None:
        self.replica = replica
        self.metrics = metrics
        self.closed = False
        replica.in_flight += 1
        metrics.child(metrics.in_flight, replica=replica.name).inc()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replica.in_flight -= 1
            self.metrics.child(self.metrics.in_flight, replica=self.replica.name).dec()


class Gateway:
    """The proxying logic, apart from the FastAPI wiring."""

    def __init__(self, replicas: Sequence[ReplicaState], policy: RoutingPolicy,
                 keyer: PrefixKeyer, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.transport = transport  # tests put fake replicas here
        self.pool = Pool("replica", list(replicas), policy)
        self.replicas = self.pool.replicas
        self.policy = policy
        self.pools = [self.pool]
        self.keyer = keyer
        self.config = config
        self.metrics = RouterMetrics(policy.name)
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self.init_gauges(self.replicas)

    def init_gauges(self, replicas: Sequence[ReplicaState]) -> None:
        """Every replica in the health and load gauges from the start (0 until checked)."""
        for r in replicas:
            self.metrics.child(self.metrics.healthy, replica=r.name).set(0)
            self.metrics.child(self.metrics.in_flight, replica=r.name).set(0)

    @property
    def all_replicas(self) -> list[ReplicaState]:
        return [r for pool in self.pools for r in pool.replicas]

    @property
    def model_replicas(self) -> list[ReplicaState]:
        """The replicas that answer /v1/models: those that answer completions."""
        return self.replicas

    # -- lifetime ---------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.upstream_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=cfg.max_connections,
                                max_keepalive_connections=cfg.max_connections),
            http1=True, transport=self.transport)
        replicas = self.all_replicas
        await asyncio.gather(*(check_once(self.client, r, cfg.health_timeout_s)
                               for r in replicas))
        self._tasks.append(asyncio.create_task(health_loop(
            self.client, replicas, self.metrics, cfg.health_interval_s,
            cfg.health_timeout_s)))
        if cfg.kv_events:
            for r in (r for pool in self.pools if pool.track_prefixes for r in pool.replicas):
                self._tasks.append(asyncio.create_task(subscribe(
                    self.client, r, self.metrics, self.admin_auth())))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()

    # -- auth -------------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        credentials = self.config.credentials
        return not credentials.configured or \
            credentials.check(client_key(request.headers)) is not None

    @staticmethod
    def upstream_auth(client_headers) -> dict[str, str]:
        """The client's own credential, for the replica to judge (its roles, its isolation):
        its Authorization header, or Anthropic's x-api-key."""
        return {name: client_headers[name] for name in ("authorization", "x-api-key")
                if client_headers and client_headers.get(name)}

    def admin_auth(self) -> dict[str, str]:
        key = self.config.admin_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    # -- routing ----------------------------------------------------------------------------
    def choose(self, keyed: Keyed, tried: set[int], pool: Pool | None = None
               ) -> ReplicaState | None:
        """The replica of `pool` (the gateway's one by default) the policy picks among those
        not yet `tried` for this request; None when none is left."""
        pool = pool or self.pool
        candidates = [_Candidate(r, tried) for r in pool.replicas]
        try:
            i = pool.policy.choose(keyed, candidates)
        except NoReplicaAvailable:
            return None
        replica = pool.replicas[i]
        m = self.metrics
        m.child(m.decisions, replica=replica.name, policy=pool.policy.name,
                reason=pool.policy.last_reason or "blind").inc()
        m.child(m.predicted_hit_tokens, replica=replica.name).inc(replica.match_tokens(keyed))
        m.child(m.prompt_tokens, replica=replica.name).inc(
            len(keyed.block_hashes) * self.keyer.block_size)
        return replica

    def _failed(self, replica: ReplicaState, kind: str, why: str, take_out: bool) -> None:
        self.metrics.child(self.metrics.errors, replica=replica.name, kind=kind).inc()
        if take_out:
            replica.mark_failed(why)
            self.metrics.child(self.metrics.healthy, replica=replica.name).set(0)

    async def keys(self, path: str, raw: bytes, key: str | None = None
                   ) -> tuple[dict[str, Any] | None, list[int]]:
        """The parsed body (None if it is not a JSON object: the replica will say why) and its
        prefix key; `key`: the client's API key (its namespace under api_key isolation)."""
        def parse_and_key() -> tuple[dict[str, Any] | None, list[int]]:
            try:
                body = json.loads(raw)
            except ValueError:
                return None, []
            if not isinstance(body, dict):
                return None, []
            return body, self.keyer.keys(path, body, key)

        if len(raw) > _KEY_INLINE_BYTES:
            return await asyncio.to_thread(parse_and_key)
        return parse_and_key()

    async def read_body(self, request: Request) -> bytes | None:
        """The whole body, or None once it passes the limit (by Content-Length before reading
        anything, or while reading a chunked upload): the gateway holds a body in memory while
        it tries replicas, so it bounds what one request may make it hold."""
        limit = self.config.max_request_body_bytes
        try:
            if int(request.headers.get("content-length", "0")) > limit:
                return None
        except ValueError:
            pass
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
        return b"".join(parts)

    async def forward(self, request: Request, path: str) -> Response:
        """A client's POST: read, parse and key it once, then route it."""
        raw = await self.read_body(request)
        if raw is None:
            limit = self.config.max_request_body_bytes
            return JSONResponse(error_body(413, f"the request body is larger than {limit:,} "
                                           "bytes (--max-request-body-bytes)", path=path),
                                status_code=413)
        body, hashes = await self.keys(path, raw, client_key(request.headers))
        headers = {"content-type": request.headers.get("content-type", "application/json"),
                   **self.upstream_auth(request.headers)}
        return await self.route(path, raw, body, Keyed(hashes), headers)

    async def route(self, path: str, raw: bytes, body: dict[str, Any] | None, keyed: Keyed,
                    headers: dict[str, str]) -> Response:
        """One replica of the pool serves the request (disagg.py overrides this with its two
        hops)."""
        stream = bool(body.get("stream")) if body is not None else False
        return self.respond(await self.send(self.pool, keyed, path, raw, headers, stream))

    async def send(self, pool: Pool, keyed: Keyed, path: str, raw: bytes,
                   headers: dict[str, str], stream: bool, timeout: float | None = None
                   ) -> Answer | str:
        """POST `raw` to a replica of `pool` chosen by its policy; retry elsewhere in the pool
        while nothing has been read of an answer. The answer, or why no replica gave one.
        `timeout`: the longest wait for a read (default --upstream-timeout)."""
        assert self.client is not None
        wait = httpx.USE_CLIENT_DEFAULT if timeout is None else httpx.Timeout(
            timeout, connect=self.config.connect_timeout_s)
        tried: set[int] = set()
        last_error = "no replica is available"
        while True:
            replica = self.choose(keyed, tried, pool)
            if replica is None:
                return last_error
            if tried:
                self.metrics.retries.inc()
            tried.add(replica.index)
            attempt = _Attempt(replica, self.metrics)
            upstream: httpx.Response | None = None
            try:  # until the response is handed out, a cancellation must not leak the load
                try:
                    upstream = await self.client.send(
                        self.client.build_request("POST", replica.url + path, content=raw,
                                                  headers=headers, timeout=wait), stream=True)
                except httpx.HTTPError as exc:
                    attempt.close()
                    last_error = f"replica {replica.name}: {type(exc).__name__}"
                    self._failed(replica, "connect", last_error, take_out=True)
                    continue
                if upstream.status_code in RETRY_STATUSES:
                    await upstream.aclose()
                    attempt.close()
                    last_error = f"replica {replica.name} answered {upstream.status_code}"
                    self._failed(replica, "status", last_error, take_out=False)
                    continue
                # The replica took it: its prompt's blocks will be computed there (history).
                if pool.track_prefixes:
                    replica.view.add(keyed.block_hashes)
                try:
                    if stream and upstream.status_code == 200:
                        chunks = upstream.aiter_raw()
                        first = await chunks.__anext__()
                    else:
                        content = await upstream.aread()
                except (httpx.HTTPError, StopAsyncIteration) as exc:
                    await upstream.aclose()
                    attempt.close()
                    last_error = f"replica {replica.name} failed before its first byte: " \
                        f"{type(exc).__name__}"
                    self._failed(replica, "connect", last_error, take_out=True)
                    continue
                self.metrics.child(self.metrics.requests, replica=replica.name).inc()
                if not (stream and upstream.status_code == 200):
                    await upstream.aclose()
                    attempt.close()
                    return Answer(replica, upstream.status_code,
                                  upstream.headers.get("content-type"), content=content)
                return Answer(replica, 200,
                              upstream.headers.get("content-type", "text/event-stream"),
                              relay=self._relay(upstream, chunks, first, attempt))
            except BaseException:
                attempt.close()
                if upstream is not None:
                    await upstream.aclose()
                raise

    def respond(self, answer: Answer | str, headers: dict[str, str] | None = None
                ) -> Response:
        """The client's response: the replica's status and body (a stream relayed chunk by
        chunk), or a 503 saying why no replica could take the request."""
        if isinstance(answer, str):
            self.metrics.unroutable.inc()
            return JSONResponse(error_body(503, f"no replica could take the request ({answer})"),
                                status_code=503)
        out_headers = {"x-kvserve-replica": answer.replica.name, **(headers or {})}
        if answer.relay is None:
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.media_type, headers=out_headers)
        return StreamingResponse(answer.relay, status_code=answer.status_code,
                                 headers=out_headers, media_type=answer.media_type)

    async def _relay(self, upstream: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                     attempt: _Attempt) -> AsyncIterator[bytes]:
        """The stream, chunk by chunk as the replica sends it; a break ends it with an error
        event. Closing (also when the client goes away) closes the upstream stream, which the
        replica sees as a disconnect and aborts the request."""
        replica = attempt.replica
        try:
            yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:
                why = f"the stream from replica {replica.name} broke: {type(exc).__name__}"
                self._failed(replica, "stream_cut", why, take_out=True)
                yield error_event(why)
        finally:
            attempt.close()
            await upstream.aclose()

    async def get_from_any(self, path: str, request: Request) -> Response:
        """A GET answered by the first available replica (/v1/models, /v1/models/{id})."""
        assert self.client is not None
        headers = self.upstream_auth(request.headers)
        for replica in self.model_replicas:
            if not replica.healthy:
                continue
            try:
                r = await self.client.get(replica.url + path, headers=headers)
            except httpx.HTTPError as exc:
                self._failed(replica, "connect", f"{path}: {type(exc).__name__}", True)
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return JSONResponse(error_body(503, "no replica is available"), status_code=503)

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health: 200 while a replica can answer, with the counts."""
        up = sum(r.healthy for r in self.replicas)
        if not up:
            return 503, error_body(503, "no replica is healthy")
        return 200, {"healthy_replicas": up, "replicas": len(self.replicas)}

    def describe(self) -> dict[str, Any]:
        """/replicas: each replica's state as the gateway sees it, by pool."""
        return {"policy": self.policy.name, "replicas": [
            {"index": r.index, "name": r.name, "role": pool.role, "url": r.url,
             "healthy": r.healthy, "in_flight": r.in_flight, "known_blocks": len(r.view)}
            for pool in self.pools for r in pool.replicas]}


def build_router_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="kvserve route", version="0.1.0", lifespan=lifespan,
                  description="Prefix-aware OpenAI-compatible gateway over kvserve replicas")
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code)

    def unauthorized(path: str = "") -> JSONResponse:
        return JSONResponse(error_body(401, "Invalid API key: pass it as 'Authorization: Bearer "
                                       "<key>' (or x-api-key)", code="invalid_api_key",
                                       path=path), status_code=401)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if not gateway.authorized(request):
            return unauthorized()
        return await gateway.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        if not gateway.authorized(request):
            return unauthorized()
        return await gateway.forward(request, "/v1/chat/completions")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API, routed as chat is (keys.py reads its conversation)."""
        if not gateway.authorized(request):
            return unauthorized("/v1/messages")
        return await gateway.forward(request, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        if not gateway.authorized(request):
            return unauthorized("/v1/messages/count_tokens")
        return await gateway.forward(request, "/v1/messages/count_tokens")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not gateway.authorized(request):
            return unauthorized()
        return await gateway.get_from_any("/v1/models", request)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> Response:
        if not gateway.authorized(request):
            return unauthorized()
        return await gateway.get_from_any(f"/v1/models/{quote(model_id, safe='/')}", request)

    # the same page: chat through the gateway, and each replica's state
    install_web(app, lambda request: {
        "key_required": gateway.config.credentials.configured,
        "key_accepted": gateway.authorized(request), "admin": False, "gateway": True})

    @app.get("/health")
    async def health() -> Response:
        status, body = gateway.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/replicas")
    async def replicas() -> dict[str, Any]:
        """Each replica's state as the gateway sees it (for operators and tests)."""
        return gateway.describe()

    return app
