"""Trace replay through kvserve's own KV cache: `KVCacheManager`, its `BlockPool` and
`PrefixIndex`, through the same calls the engine's scheduler makes (`match`, `admit`,
`cache_full_blocks`, `free`, `end_step`), without a model.

The lifetime of a request, per replica (each replica is one `KVCacheManager`):

1. It arrives at its timestamp and is routed (one replica: trivially).
2. Admission, first come first served: `kv.match`, then `kv.admit` once the pool can hold the
   whole request (`total_tokens` = prompt + output - 1, the KV that will ever be computed: the
   engine never computes the last sampled token). If it cannot, the request waits for the replica's
   earliest finishing request to release its blocks; later arrivals on that replica wait behind
   it. A request larger than the whole pool, or that the pool refuses with nothing else
   running, is rejected.
3. Prefill: its prompt counts as computed (`num_computed_tokens`), and `kv.cache_full_blocks`
   publishes the prompt's full blocks, so requests arriving while it runs can hit them.
4. It holds its blocks for prefill + decode time: uncached prompt tokens / `prefill_tokens_per_s`
   + output tokens x `decode_ms_per_token` (a replica's speed does not depend on its load; the KV
   pool is the one shared resource modelled).
5. At the finish the output tokens are appended (the trace's `output_token_ids`, or synthetic
   unique ones), their full blocks are cached like the engine caches decoded blocks, and
   `kv.free` releases everything: cached blocks stay in the index, idle, until evicted.

Cache control runs on the engine's own code too: a record's `kv_retention`/`cache_control` goes
through kv/retention.py's `retain_sequence` after admission and after publishing (the index's
clock is the replay's: the arrival time, or the request's position without timestamps), `pin`
pins the prompt once computed (kv/pins.py, bounded by `max_pinned_fraction`), and
`tenant_quota` bounds each tenant's idle blocks (by `tenant`, else the salt) as
`--kv-tenant-quota` does.

`lifetime="immediate"` skips the clock: each request is admitted, computed and released before
the next one arrives (a pure cache model, and what the engine does for requests sent one after
another). Hits and queries are the manager's own counters (vLLM's prefix_cache_hits and
prefix_cache_queries, in tokens), so a hit rate here is the one the engine would report for the
same admissions.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.kv.eviction import Belady, FutureUses, make_eviction_policy
from kvserve.kv.hashing import block_hash, chain_hashes, extra_keys
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import PinLimitError
from kvserve.kv.retention import (Retention, cache_control_range, kv_retention_range,
                                  retain_sequence)
from kvserve.kv.seq import matchable_tokens
from kvserve.router.policies import ALL_POLICIES, make_policy
from kvserve.sim.trace import Trace, TraceRequest


@dataclass
class SimSeq:
    """A simulated request: what the KV cache reads of one (`kvserve.kv.seq.CachedSeq`)."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    priority: int = 0
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    skip_reading_prefix_cache: bool = False
    num_dropped_tokens: int = 0  # the simulator bounds no cache
    tenant: str | None = None
    retention: Retention | None = None
    pin: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SimConfig:
    capacity_tokens: int  # KV pool per replica, in tokens (rounded down to whole blocks)
    block_size: int = 16
    policy: str = "lru"  # lru, lfu, priority (the engine's) or belady (offline reference)
    replicas: int = 1
    routing: str = "cache_aware"
    lifetime: str = "timed"  # or "immediate"
    decode_ms_per_token: float = 20.0
    prefill_tokens_per_s: float = 10_000.0
    balance_factor: float = 1.25  # bounded loads (consistent_hash, cache_aware)
    balance_slack: int = 0  # ... or within this many requests of the least loaded replica
    spread: bool = False  # cache_aware: new prefixes to the emptiest of the least loaded
    hash_key_tokens: int = 256  # consistent_hash: the prefix that picks the replica
    seed: int = 0
    tenant_quota: float | None = None  # --kv-tenant-quota
    max_pinned_fraction: float = 0.5  # --max-pinned-fraction

    def __post_init__(self) -> None:
        make_eviction_policy(self.policy, online_only=False)  # a clear error for a bad name
        if self.routing not in ALL_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ALL_POLICIES)}, "
                             f"got {self.routing!r}")
        if self.lifetime not in ("timed", "immediate"):
            raise ValueError(f"lifetime must be timed or immediate, got {self.lifetime!r}")
        if self.replicas < 1 or self.block_size < 1:
            raise ValueError("need at least one replica and a positive block size")
        if self.capacity_tokens < self.block_size:
            raise ValueError(f"capacity of {self.capacity_tokens} tokens holds no block of "
                             f"{self.block_size}")
        if self.policy == "belady" and self.replicas > 1:
            raise ValueError("the belady reference needs one replica (which replica sees a "
                             "request depends on routing, so the future is not known per cache)")

    @property
    def num_blocks(self) -> int:
        return self.capacity_tokens // self.block_size


class PromptHasher:
    """Chained block hashes of a prompt, computed by kvserve.kv.hashing exactly as the manager
    would (the replay hands them to the SimSeq up front so they are computed once). For a
    hash-id trace whose blocks are the cache's blocks, block k's hash depends only on the parent's
    hash and hash id k, so it is memoised on that pair."""

    def __init__(self, trace: Trace, block_size: int, memo_limit: int = 2_000_000) -> None:
        self.trace = trace
        self.bs = block_size
        self.aligned = trace.is_hash_trace and trace.block_size == block_size
        self._memo: dict[tuple[int, int], int] = {}
        self._memo_limit = memo_limit

    def __call__(self, rec: TraceRequest, tokens: list[int]) -> list[int]:
        """Hashes of the prompt's full blocks."""
        extra = extra_keys(rec.cache_salt)
        if not (self.aligned and rec.hash_ids is not None and rec.token_ids is None):
            return chain_hashes(tokens, self.bs, extra)
        bs, memo = self.bs, self._memo
        if len(memo) > self._memo_limit:
            memo.clear()
        out = []
        parent = 0
        for h in rec.hash_ids[: rec.input_length // bs]:
            key = (parent, h) if not extra else (parent, h, extra)
            got = memo.get(key)
            if got is None:  # the same bytes as the prompt's tokens, built 13x faster
                got = memo[key] = block_hash(parent, array("q", (h,)) * bs, extra)
            out.append(got)
            parent = got
        return out


class Replica:
    """One engine's KV cache: a `KVCacheManager` and the requests holding blocks in it."""

    available = True  # a simulated replica never fails (routing's ReplicaView)

    def __init__(self, config: SimConfig, future: FutureUses | None = None) -> None:
        self.config = config
        policy = make_eviction_policy(config.policy, online_only=False)
        self.belady: Belady | None = None
        if isinstance(policy, Belady):
            assert future is not None
            policy.future = future
            self.belady = policy
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
                                 enable_prefix_caching=True, eviction_policy=policy,
                                 max_pinned_fraction=config.max_pinned_fraction,
                                 tenant_quota=config.tenant_quota)
        self.now = 0.0  # the replay's clock, which retention TTLs read
        self.kv.index.clock = lambda: self.now
        self.pins_refused = 0
        self.immediate = config.lifetime == "immediate"
        self._running: list[tuple[float, int, SimSeq, TraceRequest, int]] = []
        self._seq = itertools.count()
        self.last_start = float("-inf")
        self.routed = 0
        self.admitted = 0
        self.rejected = 0
        self.prefill_computed = 0
        self.peak_held = 0
        self.queue_delay_s = 0.0

    # -- what routing sees ------------------------------------------------------------------
    @property
    def load(self) -> int:
        return self.routed if self.immediate else len(self._running)

    def match_tokens(self, request: SimSeq) -> int:
        return self.kv.match(request).num_tokens

    @property
    def cached_blocks(self) -> int:
        return self.kv.index.num_cached_blocks

    def running_requests(self) -> list[SimSeq]:
        """Requests holding blocks now (for invariant checks)."""
        return [entry[2] for entry in self._running]

    # -- the lifetime -----------------------------------------------------------------------
    def release_until(self, t: float, now: int) -> None:
        running = self._running
        while running and running[0][0] <= t:
            _, _, req, rec, pos = heapq.heappop(running)
            self._finish(req, rec, pos, now)

    def drain(self, now: int) -> None:
        self.release_until(float("inf"), now)

    def submit(self, req: SimSeq, rec: TraceRequest, arrival: float, pos: int) -> bool:
        kv = self.kv
        self.routed += 1
        if self.belady is not None:
            self.belady.now = pos
        self.now = arrival if arrival > float("-inf") else \
            (rec.timestamp if rec.timestamp is not None else float(pos))
        out = rec.output_length
        total_blocks = kv.blocks_for_tokens(req.num_tokens + max(out - 1, 0))
        if total_blocks > kv.num_blocks:
            self.rejected += 1
            return False
        start = max(arrival, self.last_start)
        self.release_until(start, pos)
        total_tokens = req.num_tokens + max(out - 1, 0)
        while True:
            match = kv.match(req)
            admission = kv.admit(req, match, req.num_tokens - match.num_tokens, total_tokens)
            if admission is not None:
                break
            if not self._running:  # nothing left to wait for: the engine's last resort, then no
                plain = kv.unblock(match, req.num_tokens, total_tokens)
                if plain is not None:
                    match = plain
                    admitted = kv.admit(req, match, req.num_tokens - match.num_tokens,
                                        total_tokens)
                    assert admitted is not None, "unblock checked the room"
                    break
                self.rejected += 1
                return False
            finish, _, r, rr, p = heapq.heappop(self._running)  # wait for the next release
            start = max(start, finish)
            self._finish(r, rr, p, pos)
        kv.end_step()  # no KV memory to move: the plan (copies of partial hits) is dropped
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
        if req.retention is not None:  # its whole path: the hit (a refresh) and the new blocks
            retain_sequence(kv, req, req.retention, req.num_tokens)
        if req.pin:
            self._pin(req)
        if out > 1:
            ok = kv.allocate_slots(req, out - 1)
            assert ok, "admission reserved the room"
        held = kv.num_blocks - kv.pool.num_available
        if held > self.peak_held:
            self.peak_held = held
        uncached = req.num_tokens - match.num_tokens
        self.prefill_computed += uncached
        self.admitted += 1
        self.queue_delay_s += start - arrival if arrival > float("-inf") else 0.0
        self.last_start = start
        if self.immediate:
            self._finish(req, rec, pos, pos + 1)
        else:
            duration = uncached / self.config.prefill_tokens_per_s + \
                out * self.config.decode_ms_per_token / 1000.0
            heapq.heappush(self._running, (start + duration, next(self._seq), req, rec, pos))
        return True

    def _pin(self, req: SimSeq) -> None:
        probe = SimSeq(f"pin-{req.request_id}", req.token_ids + [0], req.cache_salt)
        try:
            self.kv.pins.pin(probe, req.num_tokens)
        except PinLimitError:
            self.pins_refused += 1

    def _finish(self, req: SimSeq, rec: TraceRequest, pos: int, now: int) -> None:
        if self.belady is not None:
            self.belady.now = now
        out = rec.output_length
        if out > 0:
            ids = rec.output_token_ids
            if ids is None or len(ids) < out:
                ids = (ids or []) + [-(pos + 1)] * (out - len(ids or []))
            req.token_ids.extend(ids[:out])
            req.num_computed_tokens = req.num_tokens - 1
            self.kv.cache_full_blocks(req)
        self.kv.free(req)

    def stats(self) -> dict:
        kv = self.kv
        return dict(routed=self.routed, admitted=self.admitted, rejected=self.rejected,
                    query_tokens=kv.prefix_cache_queries, hit_tokens=kv.prefix_cache_hits,
                    hit_rate=kv.prefix_cache_hits / kv.prefix_cache_queries
                    if kv.prefix_cache_queries else 0.0,
                    prefill_tokens_computed=self.prefill_computed,
                    evicted_blocks=kv.index.num_evicted_blocks,
                    pinned_blocks=kv.pins.num_pinned_blocks, pins_refused=self.pins_refused,
                    peak_usage=self.peak_held / kv.num_blocks,
                    cached_blocks=kv.index.num_cached_blocks)


def future_uses(trace: Trace, block_size: int, hasher: PromptHasher) -> tuple[FutureUses,
                                                                               list[list[int]]]:
    """Every request's prompt hashes, and from them the positions where each block is used."""
    all_hashes = []
    uses = []
    for rec in trace.requests:
        tokens = trace.prompt_tokens(rec)
        hashes = hasher(rec, tokens)
        all_hashes.append(hashes)
        uses.append(hashes[: matchable_tokens(SimSeq("", tokens)) // block_size])
    return FutureUses(uses), all_hashes


def replay(trace: Trace, config: SimConfig,
           on_request: Callable[[int, list[Replica]], None] | None = None) -> dict:
    """Replay `trace` and return the run's figures (hit rate in tokens, prefill tokens saved,
    evictions, peak usage, load imbalance across replicas, wall time)."""
    t0 = time.perf_counter()
    bs = config.block_size
    hasher = PromptHasher(trace, bs)
    future, precomputed = (None, None)
    if config.policy == "belady":
        future, precomputed = future_uses(trace, bs, hasher)
    replicas = [Replica(config, future) for _ in range(config.replicas)]
    router = make_policy(config.routing, config.replicas, bs, config.seed,
                         config.balance_factor, config.hash_key_tokens,
                         config.balance_slack, config.spread) \
        if config.replicas > 1 else None
    timed = config.lifetime == "timed"
    if timed and not trace.has_timestamps:
        raise ValueError("timed replay needs a timestamp on every request: give the trace "
                         "timestamps (or a generator a rate), or replay with lifetime immediate")
    for pos, rec in enumerate(trace.requests):
        tokens = trace.prompt_tokens(rec)
        req = SimSeq(str(pos), list(tokens), rec.cache_salt, rec.priority)
        if rec.control is not None:
            apply_control(req, rec.control, pos)
        req.block_hashes = precomputed[pos] if precomputed is not None else hasher(rec, tokens)
        arrival = rec.timestamp if timed else float("-inf")
        if router is None:
            target = replicas[0]
        else:
            if timed:
                for r in replicas:
                    r.release_until(arrival, pos)
            target = replicas[router.choose(req, replicas)]
        target.submit(req, rec, arrival, pos)
        if on_request is not None:
            on_request(pos, replicas)
    for r in replicas:
        r.drain(len(trace.requests))
    elapsed = time.perf_counter() - t0
    return summarize(trace, config, replicas, elapsed)


def apply_control(req: SimSeq, control: dict, pos: int) -> None:
    """A record's cache-control fields onto its SimSeq, read as the server reads them."""
    ranges = []
    try:
        if control.get("kv_retention") is not None:
            ranges.append(kv_retention_range(control["kv_retention"]))
        if control.get("cache_control") is not None:
            ranges.append(cache_control_range(control["cache_control"], None))
    except ValueError as exc:
        raise ValueError(f"trace request {pos}: {exc}") from None
    req.retention = Retention(tuple(ranges)) if ranges else None
    req.tenant = control.get("tenant")
    req.pin = bool(control.get("pin"))


def summarize(trace: Trace, config: SimConfig, replicas: list[Replica], elapsed: float) -> dict:
    per = [r.stats() for r in replicas]
    queries = sum(p["query_tokens"] for p in per)
    hits = sum(p["hit_tokens"] for p in per)
    routed = [p["routed"] for p in per]
    work = [p["prefill_tokens_computed"] for p in per]

    def imbalance(xs: list[int]) -> float:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean else 1.0

    admitted = sum(p["admitted"] for p in per)
    return dict(
        policy=config.policy, capacity_tokens=config.num_blocks * config.block_size,
        capacity_blocks=config.num_blocks, block_size=config.block_size,
        replicas=config.replicas, routing=config.routing if config.replicas > 1 else None,
        lifetime=config.lifetime, requests=len(trace.requests), admitted=admitted,
        rejected=sum(p["rejected"] for p in per), query_tokens=queries, hit_tokens=hits,
        hit_rate=hits / queries if queries else 0.0, prefill_tokens_saved=hits,
        prefill_tokens_computed=sum(work),
        evicted_blocks=sum(p["evicted_blocks"] for p in per),
        peak_usage=max(p["peak_usage"] for p in per),
        mean_queue_delay_s=sum(r.queue_delay_s for r in replicas) / admitted
        if admitted and config.lifetime == "timed" else 0.0,
        imbalance=imbalance(routed), prefill_imbalance=imbalance(work),
        elapsed_s=elapsed, requests_per_s=len(trace.requests) / elapsed if elapsed else 0.0,
        per_replica=per)
