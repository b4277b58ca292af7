"""The three stores under the device pool: host memory, a local directory, a Redis server.

They share one small interface (`get`, `put`, `delete`, `contains`) over opaque keys and never
raise on a storage fault: an unreachable Redis, a full disk or an unreadable file is counted in
`TierStats.errors`, logged, and reported as a miss or a skipped save, because the KV can always be
recomputed and no request should fail for a cache. The host store keeps tensors as they are
(nothing leaves the process); disk and Redis keep framed, checksummed bytes (chunk.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from kvserve.kv.tiers.stats import TierStats

logger = logging.getLogger("kvserve.tiers")


class Store(Protocol):
    """A lower tier (disk, Redis): framed chunk bytes by key. The host store keeps tensors and
    is addressed directly, so it need not fit here."""

    name: str

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, blob: bytes) -> bool: ...
    def delete(self, key: str) -> None: ...
    def contains(self, key: str) -> bool: ...


class _LRUBudget:
    """Sizes by key in least-recently-used order, within a byte budget (not thread safe)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.sizes: OrderedDict[str, int] = OrderedDict()

    def touch(self, key: str) -> None:
        self.sizes.move_to_end(key)

    def add(self, key: str, size: int) -> None:
        self.used += size - self.sizes.pop(key, 0)
        self.sizes[key] = size

    def remove(self, key: str) -> int:
        size = self.sizes.pop(key, 0)
        self.used -= size
        return size

    def victims(self, size: int) -> list[str]:
        """Least recently used keys to drop so that `size` more bytes fit."""
        out, free = [], self.budget - self.used
        for key, s in self.sizes.items():
            if free >= size:
                break
            out.append(key)
            free += s
        return out


class HostStore:
    """L2: chunk tensors in process memory, LRU within a byte budget."""

    name = "host"

    def __init__(self, budget_bytes: int, stats: TierStats) -> None:
        self._lru = _LRUBudget(budget_bytes)
        self._data: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.stats = stats

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._lru.touch(key)
            return value

    def put(self, key: str, value: torch.Tensor) -> bool:
        size = value.nbytes
        with self._lock:
            if key in self._data:
                self._lru.touch(key)
                return True
            if size > self._lru.budget:
                self.stats.add("skipped_saves", "host_budget")
                return False
            for victim in self._lru.victims(size):
                self._lru.remove(victim)
                del self._data[victim]
            self._data[key] = value
            self._lru.add(key, size)
        self.stats.add("bytes_saved", self.name, size)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            if self._data.pop(key, None) is not None:
                self._lru.remove(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._lru = _LRUBudget(self._lru.budget)

    @property
    def used_bytes(self) -> int:
        return self._lru.used

    @property
    def budget(self) -> int:
        return self._lru.budget


class DiskStore:
    """L3: one file per chunk in a directory, LRU within a byte budget.

    Files are written under a unique temporary name and renamed into place, so a reader never sees
    half a file and two engines writing the same key at once both succeed (the last rename wins;
    the contents are equal). Files another engine put in the directory are found on demand.
    """

    name = "disk"
    SUFFIX = ".kvchunk"

    def __init__(self, directory: str, budget_bytes: int, stats: TierStats) -> None:
        self.directory = directory
        self.stats = stats
        self._lru = _LRUBudget(budget_bytes)
        self._lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)
        entries = []
        for entry in os.scandir(directory):
            if entry.name.endswith(self.SUFFIX):
                st = entry.stat()
                entries.append((st.st_mtime, entry.name[: -len(self.SUFFIX)], st.st_size))
        for _, key, size in sorted(entries):  # oldest first: least recently used
            self._lru.add(key, size)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key.replace(":", "_") + self.SUFFIX)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._fault("read", e)
            return None
        with self._lock:
            self._lru.add(key, len(blob))  # known now, whoever wrote it
        return blob

    def put(self, key: str, blob: bytes) -> bool:
        size = len(blob)
        with self._lock:
            if key in self._lru.sizes and os.path.exists(self._path(key)):
                self._lru.touch(key)
                return True
            if size > self._lru.budget:
                self.stats.add("skipped_saves", "disk_budget")
                return False
            victims = self._lru.victims(size)
            for victim in victims:
                self._lru.remove(victim)
        for victim in victims:
            self._unlink(victim)
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:  # a full disk (ENOSPC), a read-only or vanished directory
            self._fault("write", e)
            self._unlink_path(tmp)
            self.stats.add("skipped_saves", "disk_error")
            return False
        with self._lock:
            self._lru.add(key, size)
        self.stats.add("bytes_saved", self.name, size)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._lru.remove(key)
        self._unlink(key)

    def contains(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def clear(self) -> None:
        with self._lock:
            keys = list(self._lru.sizes)
            self._lru = _LRUBudget(self._lru.budget)
        for key in keys:
            self._unlink(key)

    @property
    def used_bytes(self) -> int:
        return self._lru.used

    def _unlink(self, key: str) -> None:
        self._unlink_path(self._path(key))

    @staticmethod
    def _unlink_path(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _fault(self, op: str, error: OSError) -> None:
        self.stats.add("errors", ("disk", f"{op}_error"))
        logger.warning("disk tier %s failed in %s: %s", op, self.directory, error)


class RedisStore:
    """L3 shared by replicas: one Redis string per chunk.

    Every call has a timeout; after a failure the store stays away for `retry_interval` seconds
    (everything is a miss meanwhile), so an unreachable or restarting server costs each step
    nothing. redis-py reconnects by itself once the server is back. `SET NX` makes concurrent
    writers of one key safe: the first value stays, and every writer wrote the same bytes.
    Capacity is the server's business (maxmemory with an LRU policy).
    """

    name = "remote"

    def __init__(self, url: str, timeout: float, retry_interval: float, stats: TierStats) -> None:
        import redis

        self._errors = (redis.exceptions.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout,
                                            socket_connect_timeout=timeout, retry=None)
        self.url = url
        self.retry_interval = retry_interval
        self.stats = stats
        self._down_until = 0.0
        self._was_down = False
        self.on_recover: "Callable[[], None] | None" = None  # the server may have lost its keys

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, *args, **kwargs):
        if not self.available:
            return None
        try:
            result = fn(*args, **kwargs)
        except self._errors as e:
            self._down_until = time.monotonic() + self.retry_interval
            self.stats.add("errors", ("remote", type(e).__name__))
            if not self._was_down:
                logger.warning("remote tier %s unreachable (%s: %s); treating it as a miss for "
                               "%.1f s", self.url, type(e).__name__, e, self.retry_interval)
            self._was_down = True
            return None
        if self._was_down:
            logger.info("remote tier %s is back", self.url)
            self._was_down = False
            if self.on_recover is not None:
                self.on_recover()
        return result

    def get(self, key: str) -> bytes | None:
        return self._call(self._client.get, key)

    def put(self, key: str, blob: bytes) -> bool:
        done = self._call(self._client.set, key, blob, nx=True)
        if done is None and not self.available:
            self.stats.add("skipped_saves", "remote_error")
            return False
        if done:
            self.stats.add("bytes_saved", self.name, len(blob))
        return True

    def delete(self, key: str) -> None:
        self._call(self._client.delete, key)

    def contains(self, key: str) -> bool:
        return bool(self._call(self._client.exists, key))

    def close(self) -> None:
        self._client.close()
