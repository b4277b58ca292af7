"""The storage tiers as one object: save chunks down, find and prefetch them back up.

Saving: the engine thread hands over a chunk tensor (read out of device blocks when the device pool
evicts it, or as soon as it is computed under write-through). It goes into host memory at once
and onto a bounded queue for a background thread, which frames it and writes it to disk and Redis.
A full queue skips the save: the engine never waits for storage.

Loading: when a request arrives, a background prefetch walks its chunks in order and promotes
each one found on disk or in Redis (or, for a request whose prompt another instance computed,
on that instance: kv/tiers/peer.py) into host memory, stopping at the first miss. The scheduler
leaves the request waiting (others run) until its prefetch is done or `prefetch_timeout` passes,
then takes whatever is in host memory by then. So no step ever blocks on disk or on a slow Redis.

Trust: whatever comes from below host memory (a disk file, a Redis value, a producer's answer)
is decoded and its MAC verified (chunk.py, keyed by auth.py's deployment key) before it is put
into host memory, so unverified KV never reaches the cache any request reads from. A chunk that
fails is a miss: counted in the tier errors (`corrupt_chunk`, or `auth_failed` for a well-formed
chunk with a bad MAC), deleted from a disk or Redis tier (so the recomputed chunk can replace
it), and the KV recomputed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvserve.kv.tiers.auth import load_auth_key
from kvserve.kv.tiers.chunk import ChunkAuthError, ChunkIdentity, CorruptChunkError, decode, \
    encode
from kvserve.kv.tiers.config import TierConfig
from kvserve.kv.tiers.peer import PeerStore
from kvserve.kv.tiers.stats import TierStats
from kvserve.kv.tiers.stores import DiskStore, HostStore, RedisStore, Store

logger = logging.getLogger("kvserve.tiers")

# Without an L2, prefetched chunks still need somewhere to wait for their request.
_STAGING_BYTES = 1024**3


@dataclass
class FoundChunk:
    chunk_hash: int
    data: torch.Tensor  # [layers, 2, chunk_size, kv_heads, head_dim]
    source: str  # where it was found: host, disk or remote


class Prefetch:
    """One request's background load: done, or given up on after the deadline."""

    def __init__(self, future: concurrent.futures.Future, deadline: float) -> None:
        self.future = future
        self.deadline = deadline

    @property
    def pending(self) -> bool:
        return not self.future.done() and time.monotonic() < self.deadline

    def wait(self, seconds: float) -> None:
        try:
            self.future.result(timeout=max(0.0, min(seconds, self.deadline - time.monotonic())))
        except Exception:  # a timeout here, or a bug reported by the worker's own log
            pass


_MAX_LOAD_ERRORS = 4096  # failed loads remembered for the cache report
_AUTH_WARNING_INTERVAL = 60.0  # seconds between warnings of one tier's MAC failures


class TieredKVStore:
    def __init__(self, config: TierConfig, identity: ChunkIdentity) -> None:
        self.config = config
        self.identity = identity
        self.stats = TierStats()
        self.host = HostStore(config.max_local_cpu_bytes if config.local_cpu else _STAGING_BYTES,
                              self.stats)
        self.disk = DiskStore(config.local_disk, config.max_local_disk_bytes, self.stats) \
            if config.local_disk else None
        self.remote = RedisStore(config.remote_url, config.remote_timeout,
                                 config.remote_retry_interval, self.stats) \
            if config.remote_url else None
        self._lower: list[Store] = [s for s in (self.disk, self.remote) if s is not None]
        if self.remote is not None:
            self.remote.on_recover = self._forget_written
        self._origin: dict[str, str] = {}  # key -> tier a prefetch promoted it from
        self._written: OrderedDict[str, None] = OrderedDict()  # keys sent below, newest last
        # key -> (tier, kind) of recent failed loads, for the cache report's `tier_error`
        self._load_errors: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._saves: queue.Queue = queue.Queue(maxsize=config.max_pending_saves)
        self._saver = threading.Thread(target=self._save_loop, name="kvserve-tier-save",
                                       daemon=True)
        self._saver.start()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "kvserve-tier-load")
        self._peers: OrderedDict[str, PeerStore] = OrderedDict()  # by address, newest last
        self._auth_warned: dict[str, float] = {}  # tier -> when its MAC failures were logged

    @cached_property
    def auth_key(self) -> bytes:
        """The deployment's chunk key (auth.py), read when a chunk first leaves or enters the
        process: a host-memory-only tier never needs one (nor creates the default file)."""
        return load_auth_key(self.config.auth_key_file)

    @property
    def has_lower_tiers(self) -> bool:
        return bool(self._lower)

    def key(self, chunk_hash: int) -> str:
        return self.identity.key(chunk_hash)

    # -- saving -----------------------------------------------------------------------------
    def knows(self, chunk_hash: int) -> bool:
        """Saved already (in host memory, or sent below by this process): no need to read it
        out of the device again."""
        key = self.key(chunk_hash)
        with self._lock:
            if key in self._written:
                return True
        return self.config.local_cpu and self.host.contains(key)

    def save(self, chunk_hash: int, data: torch.Tensor) -> None:
        key = self.key(chunk_hash)
        if self.config.local_cpu:
            self.host.put(key, data)
        if not self._lower:
            return
        with self._lock:
            if key in self._written:
                return
            self._written[key] = None
            if len(self._written) > 1_000_000:
                self._written.popitem(last=False)
        try:
            self._saves.put_nowait((key, data))
        except queue.Full:
            with self._lock:
                self._written.pop(key, None)
            self.stats.add("skipped_saves", "backlog")

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            try:
                if item is None:
                    return
                key, data = item
                blobs: dict[str, bytes] = {}
                saved = True
                for store in self._lower:
                    serde = self.config.remote_serde if store is self.remote else "naive"
                    if serde not in blobs:
                        blobs[serde] = encode(key, data, serde, auth_key=self.auth_key)
                    saved = store.put(key, blobs[serde]) and saved
                if not saved:  # let a later eviction try again
                    with self._lock:
                        self._written.pop(key, None)
            except Exception:  # never let one bad save stop the saver
                logger.exception("saving a KV chunk failed")
            finally:
                self._saves.task_done()

    def _forget_written(self) -> None:
        """Redis came back, possibly empty: chunks sent before may have to be sent again."""
        with self._lock:
            self._written.clear()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued saves are written (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._saves.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- loading ----------------------------------------------------------------------------
    def prefetch(self, chunk_hashes: Sequence[int], peer: str | None = None) -> Prefetch | None:
        """Start promoting these consecutive chunks from disk/Redis (and first from the kvserve
        instance at `peer`, host:port, that computed them) into host memory."""
        stores = ([self._peer(peer)] if peer is not None else []) + self._lower
        if not stores or not chunk_hashes:
            return None
        # No more than host memory holds at once: the last chunks would evict the first ones.
        fit = self.host.budget // self.identity.chunk_bytes
        keys = [self.key(h) for h in chunk_hashes[:fit]]
        if not keys:
            return None
        future = self._loader.submit(self._promote, keys, stores)
        return Prefetch(future, time.monotonic() + self.config.prefetch_timeout)

    def _peer(self, address: str) -> PeerStore:
        """The store over one producer, kept for the next request from it (a few at most)."""
        with self._lock:
            store = self._peers.pop(address, None)
            if store is None:
                store = PeerStore(address, self.identity.chunk_bytes,
                                  max(self.config.prefetch_timeout, 0.1), self.stats)
            self._peers[address] = store
            while len(self._peers) > 16:
                self._peers.popitem(last=False)[1].close()
        return store

    def _promote(self, keys: list[str], stores: list[Store]) -> int:
        for n, key in enumerate(keys):
            if self.host.contains(key):
                continue
            for store in stores:
                data = self._load(store, key)
                if data is not None:
                    if not self.host.put(key, data):
                        return n
                    with self._lock:
                        self._origin[key] = store.name
                    break
            else:
                return n
        return len(keys)

    def _load(self, store: Store, key: str) -> torch.Tensor | None:
        start = time.perf_counter()
        blob = store.get(key)
        if blob is None:
            return None
        try:
            data = decode(key, blob, self.identity.dtype, self.identity.shape,
                          auth_key=self.auth_key)
        except CorruptChunkError as e:
            kind = "auth_failed" if isinstance(e, ChunkAuthError) else "corrupt_chunk"
            self.stats.add("errors", (store.name, kind))
            self._note_load_error(key, store.name, kind)
            self._warn_bad_chunk(store.name, kind, e)
            store.delete(key)
            with self._lock:
                self._written.pop(key, None)  # so that the recomputed chunk is saved again
            return None
        self.stats.observe_load(store.name, time.perf_counter() - start)
        self.stats.add("bytes_loaded", store.name, len(blob))
        return data

    def _warn_bad_chunk(self, tier: str, kind: str, error: CorruptChunkError) -> None:
        """Every corrupt chunk is logged; MAC failures once a minute per tier (a planted or
        misconfigured tier would otherwise flood the log; the counter has them all)."""
        if kind == "auth_failed":
            now = time.monotonic()
            with self._lock:
                if now - self._auth_warned.get(tier, -_AUTH_WARNING_INTERVAL) \
                        < _AUTH_WARNING_INTERVAL:
                    return
                self._auth_warned[tier] = now
            logger.warning("dropping KV chunks that fail their MAC from the %s tier (forged, or "
                           "written with another KV auth key; counted as tier error "
                           "auth_failed): %s", tier, error)
            return
        logger.warning("dropping a bad KV chunk from the %s tier: %s", tier, error)

    def _note_load_error(self, key: str, tier: str, kind: str) -> None:
        with self._lock:
            self._load_errors[key] = (tier, kind)
            self._load_errors.move_to_end(key)
            if len(self._load_errors) > _MAX_LOAD_ERRORS:
                self._load_errors.popitem(last=False)

    def load_error(self, chunk_hash: int) -> tuple[str, str] | None:
        """(tier, kind) of the last failed load of this chunk, if it is recent."""
        with self._lock:
            return self._load_errors.get(self.key(chunk_hash))

    def lookup(self, chunk_hashes: Sequence[int]) -> list[FoundChunk]:
        """The leading run of these chunks that host memory holds now (engine thread)."""
        found = []
        for h in chunk_hashes:
            key = self.key(h)
            data = self.host.get(key)
            if data is None:
                break
            with self._lock:
                source = self._origin.get(key, "host")
            found.append(FoundChunk(h, data, source))
        return found

    def lower_run(self, chunk_hashes: Sequence[int]) -> list[FoundChunk]:
        """The leading run of these chunks that host memory or a lower tier holds now, as far
        as a prefetch would promote them (what host memory fits), their KV not read (`data`
        None): what a request for them would find after its prefetch (the cache report's
        explain; disk: a file's existence, Redis: one EXISTS per chunk)."""
        found = []
        fit = self.host.budget // self.identity.chunk_bytes
        for h in chunk_hashes[:fit]:
            key = self.key(h)
            if self.host.contains(key):
                with self._lock:
                    source = self._origin.get(key, "host")
            else:
                source = next((s.name for s in self._lower if s.contains(key)), None)
                if source is None:
                    break
            found.append(FoundChunk(h, None, source))  # type: ignore[arg-type]
        return found

    def consumed(self, chunks: Sequence[FoundChunk]) -> None:
        """These chunks were loaded into the device: count them, and drop staging copies."""
        for c in chunks:
            key = self.key(c.chunk_hash)
            with self._lock:
                self._origin.pop(key, None)
            if c.source == "host":
                self.stats.add("bytes_loaded", "host", c.data.nbytes)
            if not self.config.local_cpu:
                self.host.delete(key)

    # -- admin ------------------------------------------------------------------------------
    def clear(self, tiers: Sequence[str] = ("host", "disk")) -> None:
        """Forget the chunks of this process's host and disk tiers (benchmarks, tests); Redis is
        shared with other engines and left alone."""
        if "host" in tiers:
            self.host.clear()
        if "disk" in tiers and self.disk is not None:
            self.disk.clear()
        with self._lock:
            self._written.clear()
            self._origin.clear()

    def usage(self) -> dict[str, int]:
        out = {"host": self.host.used_bytes}
        if self.disk is not None:
            out["disk"] = self.disk.used_bytes
        return out

    def close(self) -> None:
        self.flush(timeout=5.0)
        try:
            self._saves.put(None, timeout=5.0)  # the saver stops after what is queued
        except queue.Full:  # a saver stuck on a dead remote: it is a daemon thread, leave it
            logger.warning("closing the KV tiers with %d chunk saves still queued",
                           self._saves.qsize())
        self._loader.shutdown(wait=False, cancel_futures=True)
        for store in self._peers.values():
            store.close()
        if self.remote is not None:
            self.remote.close()
