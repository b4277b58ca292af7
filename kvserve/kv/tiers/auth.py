"""The deployment's KV authentication key: what makes a stored or transferred chunk trusted.

A chunk's xxh3 checksum (chunk.py) catches accidents, not an adversary: anyone who can write a
disk file, a Redis value or answer a consumer's pull can recompute it. So every framed chunk
also carries a MAC keyed by a secret the deployment shares, and a chunk whose MAC does not
verify is a miss (counted, then recomputed), never KV.

The MAC is AES-256-GMAC (GCM authenticating the chunk as associated data, nothing encrypted)
with a random 96-bit nonce per chunk, under a key derived from the secret (`_gmac_key`). Why
not HMAC-SHA256: it ran at 1.9 GB/s here (SHA-NI), ~18 ms per 32 MiB prefix on every disk,
Redis or peer load and on every save, a third of a disk hit's TTFT; GMAC runs on AES-NI and
carry-less multiplies at ~25 GB/s (~1 ms), with the same guarantee: no one without the secret
makes a chunk that verifies. Random nonces keep it safe for ~2^32 chunks per secret (NIST
SP 800-38D); rotate the secret long before a deployment writes that many.

Where the key comes from, first match wins:
1. a key file named in the configuration (`auth_key_file` of the tier config, or of
   `kv_transfer_config`'s `kv_connector_extra_config`);
2. the environment variable `KVSERVE_KV_AUTH_KEY`;
3. a random key created once, mode 0600, under the kvserve cache directory (kvserve/utils/paths.py):
   processes of one user on one machine agree without configuration (a producer and its
   consumer, a disk tier reused across restarts); replicas on other machines, or sharing a
   Redis, must be given the same key by 1 or 2.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import secrets
import uuid
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvserve.utils.paths import cache_dir

logger = logging.getLogger("kvserve.tiers")

ENV_VAR = "KVSERVE_KV_AUTH_KEY"
DEFAULT_KEY_FILE = "kv-auth.key"
MIN_KEY_BYTES = 16  # a shorter secret is guessable; a generated one is 32 random bytes (hex)
_NONCE_BYTES, _TAG_BYTES = 12, 16
MAC_BYTES = _NONCE_BYTES + _TAG_BYTES  # what a framed chunk carries: the nonce, then the tag
_KDF_LABEL = b"kvserve KV chunk MAC: AES-256-GMAC"


@functools.lru_cache(maxsize=8)
def _gmac_key(secret: bytes) -> bytes:
    """The AES key of a deployment secret (any length >= MIN_KEY_BYTES): HMAC-SHA256 of a fixed
    label, so the secret itself keys nothing but this derivation."""
    return hmac.digest(secret, _KDF_LABEL, "sha256")


def mac_seal(secret: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    """A fresh nonce and the GMAC tag of `parts` (read in place, never joined: a chunk's payload
    is megabytes)."""
    nonce = os.urandom(_NONCE_BYTES)
    mac = Cipher(algorithms.AES(_gmac_key(secret)), modes.GCM(nonce)).encryptor()
    for part in parts:
        mac.authenticate_additional_data(part)
    mac.finalize()
    return nonce + mac.tag


def mac_verify(secret: bytes, parts: Sequence[bytes | memoryview],
               sealed: bytes | memoryview) -> bool:
    """Whether `sealed` (nonce + tag, as `mac_seal` wrote it) authenticates `parts` under the
    secret; the tag is compared in constant time by OpenSSL."""
    if len(sealed) != MAC_BYTES:
        return False
    nonce, tag = bytes(sealed[:_NONCE_BYTES]), bytes(sealed[_NONCE_BYTES:])
    mac = Cipher(algorithms.AES(_gmac_key(secret)), modes.GCM(nonce, tag)).decryptor()
    for part in parts:
        mac.authenticate_additional_data(part)
    try:
        mac.finalize()
    except InvalidTag:
        return False
    return True


def load_auth_key(path: str | None = None) -> bytes:
    """The key chunks are authenticated with (see the module docstring for the order)."""
    if path:
        return read_key_file(path)
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return _checked(env.encode(), f"${ENV_VAR}")
    return _default_key()


def read_key_file(path: str | os.PathLike) -> bytes:
    """A key file's contents (surrounding whitespace stripped); ValueError when unreadable or
    too short, so a misconfigured deployment fails at start-up, not on every chunk."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16).strip()
    except OSError as e:
        raise ValueError(f"KV auth key file {str(path)!r}: {e.strerror or e}") from None
    return _checked(data, f"KV auth key file {str(path)!r}")


def _checked(key: bytes, what: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{what} holds {len(key)} bytes; a KV auth key needs at least "
                         f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)")
    return key


def _default_key() -> bytes:
    """The per-user key under the cache directory, created atomically on first use: written
    under a private temporary name, then hard-linked into place, so two processes starting
    together end up reading the same complete file."""
    path = cache_dir() / DEFAULT_KEY_FILE
    if not path.exists():
        _create_key_file(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        logger.warning("KV auth key %s is readable by others (mode %o): whoever reads it can "
                       "forge KV chunks; chmod 600 it", path, mode)
    return read_key_file(path)


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
        try:
            os.link(tmp, path)
            logger.info("KV auth key: created %s (give other machines the same key)", path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        os.unlink(tmp)
