"""Who may call what: API keys, the admin role, and the caller each handler is given.

Two roles. An ordinary caller (any `--api-key`) sends requests and learns about its own
prompts only: its reports and explain answers say nothing of what the cache holds beyond the
tokens it sent, and it sees and releases only its own pins. The admin (`--admin-api-key`) may
also do what reaches every tenant's cache: `POST /reset_prefix_cache`, `GET /v1/kv_events`
(the hashes of everyone's blocks), `GET /v1/cache/tree` (the prefix tree, with text), the full
explain (cached text, the `salt` reason), other callers' pins, `/debug/memory`.

Without any key configured, nobody is told apart, and nobody is the admin: every caller gets
the ordinary caller's private reports, and the admin endpoints are off, on a loopback address
as on any other, unless `--allow-unauthenticated-admin` says every caller may be the admin.
Why not loopback: the address the server binds says nothing about who reaches it (a reverse
proxy on the same host makes every remote user a loopback peer, and so does any other local
user or process). With keys but no admin key, the admin endpoints are off likewise (the same
flag opens them to every key holder).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.server.anthropic_protocol import shaped_error
from kvserve.server.protocol import APIError
from kvserve.frontend.tenancy import KV_ISOLATION, Credentials, bearer_of, cache_namespace
from kvserve.web import is_public
from kvserve.utils.validation import check_cache_salt

logger = logging.getLogger("kvserve")

# Cache-wide routes: only the admin (the rest tell callers apart inside the handler).
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/v1/kv_events", "/v1/cache/tree",
                         "/debug/memory", "/debug/memory/trim"})


@dataclass(frozen=True)
class Caller:
    """The credential a request came with, as handlers need it."""

    admin: bool
    key: str | None = None  # the digest of its API key (None: no key is configured)


@dataclass(frozen=True)
class AccessPolicy:
    """The server's credentials and isolation, decided once at start-up."""

    credentials: Credentials = field(default_factory=Credentials)
    protect_all: bool = False  # the key on every route but /health (--api-key-protect-all)
    admin_open: bool = False  # the admin role without an admin key (only by the flag)
    kv_isolation: str = "cache_salt"
    tenant_by: str = "cache_salt"  # whose blocks are whose under --kv-tenant-quota

    @classmethod
    def build(cls, credentials: Credentials, *, protect_all: bool = False,
              allow_unauthenticated_admin: bool = False, kv_isolation: str = "cache_salt",
              tenant_by: str | None = None) -> "AccessPolicy":
        if kv_isolation not in KV_ISOLATION:
            raise ValueError(f"--kv-isolation must be one of {KV_ISOLATION}, got "
                             f"{kv_isolation!r}")
        if kv_isolation == "api_key" and not credentials.configured:
            raise ValueError("--kv-isolation api_key isolates callers by their API key: give "
                             "--api-key (or --api-key-file) with a key per tenant")
        if tenant_by == "api_key" and not credentials.configured:
            raise ValueError("--kv-tenant-by api_key counts blocks by API key: give --api-key "
                             "(or --api-key-file) with a key per tenant")
        if protect_all and not credentials.configured:
            raise ValueError("--api-key-protect-all needs --api-key, --api-key-file or "
                             "--admin-api-key")
        return cls(credentials, protect_all, allow_unauthenticated_admin, kv_isolation,
                   tenant_by or ("api_key" if kv_isolation == "api_key" else "cache_salt"))

    def describe_admin(self) -> str:
        """The start-up log's line on the admin endpoints."""
        if self.credentials.admins:
            return f"admin endpoints: {len(self.credentials.admins)} admin key(s)"
        if self.admin_open:
            return "admin endpoints: open to every caller (--allow-unauthenticated-admin)"
        if not self.credentials.configured:
            return "admin endpoints: off, every caller gets its own private reports (no admin " \
                "key; --allow-unauthenticated-admin opens them)"
        return "admin endpoints: off (no --admin-api-key; see --allow-unauthenticated-admin)"

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller of a request with this Authorization header; None for a key that is
        not accepted (the route decides whether that matters)."""
        if not self.credentials.configured:
            return Caller(self.admin_open)
        digest = self.credentials.check(bearer_of(authorization))
        if digest is None:
            return None
        return Caller(self.admin_open or self.credentials.is_admin(digest), digest)

    def protected(self, path: str) -> bool:
        if self.protect_all:  # the page asks for the key itself: its files are public
            return path != "/health" and not is_public(path)
        return path.startswith("/v1") or path in ADMIN_PATHS

    def session(self, caller: Caller) -> dict[str, Any]:
        """What the web page may show this caller (kvserve/web: GET /ui/session)."""
        configured = self.credentials.configured
        return {"key_required": configured, "key_accepted": caller.key is not None
                or not configured, "admin": caller.admin, "gateway": False}

    def admin_refusal(self) -> str:
        if self.credentials.admins:
            return "this endpoint reaches every caller's cache: it needs an admin API key " \
                "(--admin-api-key)"
        return "this endpoint reaches every caller's cache, and this server has no admin " \
            "credential: start it with --admin-api-key KEY (or, on a trusted network, " \
            "--allow-unauthenticated-admin)"

    def namespace(self, caller: Caller, cache_salt: str | None) -> str | None:
        """The cache namespace (the engine's cache_salt) of a request (kvserve/frontend/tenancy.py);
        the caller's own salt is checked first, as the engine would check it."""
        try:
            check_cache_salt(cache_salt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="cache_salt") from None
        return cache_namespace(self.kv_isolation, cache_salt, caller.key)

    def tenant(self, caller: Caller) -> str | None:
        """A request's tenant for quotas: its key under api_key (None: the engine takes the
        namespace)."""
        if self.tenant_by == "api_key" and caller.key is not None:
            return "key:" + caller.key
        return None


ANONYMOUS = Caller(admin=False)


def caller_of(request: Request) -> Caller:
    """The caller the middleware found (none found: a caller without a key or a role)."""
    return getattr(request.state, "caller", None) or ANONYMOUS


class AuthMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would wrap `receive` and break the disconnect
    detection): `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on /v1/* and the
    admin routes, as vLLM does (with `protect_all`, on every route but /health and the page);
    403 on an admin route for a caller who is not the admin. The caller goes to the handlers
    in `request.state.caller`."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        authorization = api_key = None
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":  # Anthropic's header
                api_key = value.decode("latin-1")
        if authorization is None and api_key is not None:
            authorization = f"Bearer {api_key}"
        path = scope.get("path", "")
        caller = self.policy.caller(authorization)
        if caller is None:
            if self.policy.protected(path):
                await JSONResponse(shaped_error(path, 401, "Invalid API key: pass it as "
                                                "'Authorization: Bearer <key>' (or x-api-key)",
                                                code="invalid_api_key"),
                                   status_code=401)(scope, receive, send)
                return
            caller = ANONYMOUS
        if path in ADMIN_PATHS and not caller.admin:
            await JSONResponse(shaped_error(path, 403, self.policy.admin_refusal(),
                                            code="insufficient_permissions"),
                               status_code=403)(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)
