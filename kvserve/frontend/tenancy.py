"""Who a request comes from, and which cache namespace its blocks live in: the one rule the
server (kvserve/server/auth.py) and the gateway (kvserve/router/keys.py) both follow.

A KV block is shared only between requests whose extra keys match (kv/hashing.py). The
namespace chosen here is what the engine takes as the request's `cache_salt`, so it reaches
every place a salt reaches — the prefix index, the storage tiers (Redis shared by replicas
included), the KV events and the gateway's prefix keys — without any of them knowing about API
keys:

* `--kv-isolation none`: one namespace for everybody; `cache_salt` is ignored (a fleet whose
  clients send per-user salts out of habit can still share).
* `cache_salt` (the default, vLLM's behaviour): the request's `cache_salt`, if it gives one.
* `api_key`: the caller's key, as a digest, and within it the caller's `cache_salt`; so one
  tenant's cached prefix never shortens another tenant's time to first token.

API keys are never kept or compared as they are: a key is known by its SHA-256 digest, looked
up in a set of digests (a lookup whose timing says nothing about the keys), and the digest is
also the tenant's name for quotas and pins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

KV_ISOLATION = ("none", "cache_salt", "api_key")
_DIGEST_CHARS = 32  # 128 bits: two tenants' keys never meet by chance


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]


def bearer_of(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header's value (None without one)."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:] or None


def client_key(headers: Mapping[str, str]) -> str | None:
    """A request's API key: its bearer token, else Anthropic's `x-api-key` header."""
    return bearer_of(headers.get("authorization")) or headers.get("x-api-key") or None


def cache_namespace(isolation: str, cache_salt: str | None, key: str | None) -> str | None:
    """The `cache_salt` the engine gets for a request under `isolation`, given the caller's
    own salt and the digest of its key (None: the caller gave none). Under `api_key` the
    salt is hashed so the namespace stays short whatever the salt's length; its prefix
    `key:` cannot be a caller's own salt there, since every caller has a key."""
    if isolation == "none":
        return None
    if isolation == "cache_salt" or key is None:
        return cache_salt
    if isolation != "api_key":
        raise ValueError(f"kv_isolation must be one of {KV_ISOLATION}, got {isolation!r}")
    if cache_salt is None:
        return f"key:{key}"
    return f"key:{key}:{key_digest(cache_salt)}"


def read_key_file(path: str | Path) -> list[str]:
    """llama-server's --api-key-file: one key per line; blank lines and lines starting with
    '#' are skipped, surrounding spaces dropped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one key per line)")
    return keys


@dataclass(frozen=True)
class Credentials:
    """The keys a server or gateway accepts, as digests: ordinary callers' and admins'. An
    admin key is also accepted wherever an ordinary key is."""

    users: frozenset[str] = frozenset()
    admins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, users: Iterable[str] = (), admins: Iterable[str] = ()) -> "Credentials":
        users, admins = list(users), list(admins)
        for key in users + admins:
            if not key or key != key.strip():
                raise ValueError("an API key must be non-empty, without surrounding spaces")
        return cls(frozenset(map(key_digest, users)), frozenset(map(key_digest, admins)))

    @classmethod
    def from_args(cls, api_keys: Iterable[str] | None, key_file: str | None,
                  admin_keys: Iterable[str] | None, env: Mapping[str, str]) -> "Credentials":
        """`--api-key` (repeatable), `--api-key-file`, `--admin-api-key` (repeatable), and
        KVSERVE_API_KEY / KVSERVE_ADMIN_API_KEY when no flag of that kind is given."""
        users = list(api_keys or ())
        if key_file:
            users += read_key_file(key_file)
        if not users and env.get("KVSERVE_API_KEY"):
            users = [env["KVSERVE_API_KEY"]]
        admins = list(admin_keys or ())
        if not admins and env.get("KVSERVE_ADMIN_API_KEY"):
            admins = [env["KVSERVE_ADMIN_API_KEY"]]
        return cls.of(users, admins)

    @property
    def configured(self) -> bool:
        return bool(self.users or self.admins)

    def check(self, key: str | None) -> str | None:
        """The digest of `key` if it is accepted, else None."""
        if key is None:
            return None
        digest = key_digest(key)
        return digest if digest in self.users or digest in self.admins else None

    def is_admin(self, digest: str | None) -> bool:
        return digest is not None and digest in self.admins
