"""Configuration of the storage tiers below the device KV pool.

Key names follow LMCache's configuration file where the meaning is the same (`chunk_size`,
`local_cpu`, `max_local_cpu_size` and `max_local_disk_size` in GB, `local_disk`, `remote_url`,
`remote_serde`), so an LMCache YAML file carries over; the few keys of our own (`write_policy`,
`remote_timeout`, `auth_key_file`, ...) are named in the same style. A file, a JSON string, a
dict or a `TierConfig` are all accepted, and an unknown key is an error that lists the known
ones: a typo must not silently turn a tier off.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import yaml

from kvserve.kv.tiers.auth import read_key_file

SERDES = ("naive", "zlib")
WRITE_POLICIES = ("write_back", "write_through")
GB = 1024**3


@dataclass
class TierConfig:
    chunk_size: int = 256  # tokens per stored chunk; a multiple of the engine's block_size
    local_cpu: bool = True  # L2: host memory
    max_local_cpu_size: float = 5.0  # GB
    local_disk: str | None = None  # L3: a directory ("file:///path/" or a plain path)
    max_local_disk_size: float = 0.0  # GB
    remote_url: str | None = None  # L3 shared by replicas: redis://host:port/db
    remote_serde: str = "naive"  # naive (raw bytes) or zlib (byte-plane shuffle + zlib)
    write_policy: str = "write_back"  # save on eviction from the device, or as soon as computed
    remote_timeout: float = 0.5  # seconds: one Redis call gives up after this
    prefetch_timeout: float = 2.0  # seconds a request waits for its disk/remote loads at most
    remote_retry_interval: float = 2.0  # seconds to leave an unreachable Redis alone
    max_pending_saves: int = 256  # chunks queued for disk/remote; beyond, saves are skipped
    model_name: str | None = None  # model identity in keys; default: a fingerprint of the files
    # The secret that authenticates chunks on disk, in Redis and in transfers (tiers/auth.py);
    # default: $KVSERVE_KV_AUTH_KEY, else a per-user key file in the kvserve cache directory.
    auth_key_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) \
                or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        for name in ("max_local_cpu_size", "max_local_disk_size", "remote_timeout",
                     "prefetch_timeout", "remote_retry_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if self.remote_serde not in SERDES:
            raise ValueError(f"remote_serde must be one of {SERDES}, got {self.remote_serde!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, "
                             f"got {self.write_policy!r}")
        if self.local_disk is not None:
            self.local_disk = _disk_path(self.local_disk)
            if self.max_local_disk_size <= 0:
                raise ValueError("local_disk is set but max_local_disk_size is 0: give the disk "
                                 "tier a budget in GB")
        if self.auth_key_file is not None:
            if not isinstance(self.auth_key_file, str) or not self.auth_key_file:
                raise ValueError(f"auth_key_file must name a file, got {self.auth_key_file!r}")
            read_key_file(self.auth_key_file)  # unreadable or too short: refused at start-up
        if self.remote_url is not None:
            url = urlparse(self.remote_url)
            if url.scheme not in ("redis", "rediss") or not url.hostname:
                raise ValueError("remote_url must look like redis://host:port/db, "
                                 f"got {self.remote_url!r}")

    @property
    def enabled(self) -> bool:
        return self.local_cpu or self.local_disk is not None or self.remote_url is not None

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)


def _disk_path(value: str) -> str:
    if value.startswith("file://"):
        value = urlparse(value).path
    if not value:
        raise ValueError("local_disk must name a directory")
    return os.path.abspath(os.path.expanduser(value))


def load_tier_config(source: "str | dict[str, Any] | TierConfig | None") -> TierConfig | None:
    """A TierConfig from a YAML file path, a JSON/YAML string, a dict, or itself (None stays)."""
    if source is None or isinstance(source, TierConfig):
        return source
    if isinstance(source, str):
        if os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        else:
            try:
                data = json.loads(source)
            except json.JSONDecodeError:
                raise ValueError(f"kv tier config {source!r} is neither a file nor JSON") from None
    elif isinstance(source, dict):
        data = source
    else:
        raise ValueError(f"kv tier config must be a file path, JSON or a dict, "
                         f"got {type(source).__name__}")
    if not isinstance(data, dict):
        raise ValueError("a kv tier config must be a mapping of keys to values")
    check_keys(TierConfig, data, "kv tier config")
    return TierConfig(**data)


def check_keys(cls, data: dict[str, Any], what: str) -> None:
    """Refuse keys the dataclass `cls` does not have, listing the known ones (a typo must not
    silently turn something off)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; known: {sorted(known)}")
