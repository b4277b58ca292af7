"""Routing policies: which of N replicas serves a request.

One implementation with two users: the simulator (kvserve/sim/replay.py) drives these with
replicas that are real `KVCacheManager`s, and the gateway (kvserve/router/app.py) with real
`kvserve serve` processes, whose caches it knows approximately (kvserve/router/prefix_view.py).

A policy sees the request's chained block hashes (kvserve/kv/hashing.py, the names blocks go by
in every process) and, per replica, whether it is available, its load and how many of the
request's tokens its prefix cache holds. Unavailable replicas (the gateway's failed ones) are
skipped; the simulator's are always available.

- random, round_robin: cache-blind baselines.
- least_loaded: the replica with the fewest requests in flight (cache-blind, load-aware).
- consistent_hash: the request's prefix (the chained hash of its first `key_tokens` tokens, in
  whole blocks) picks a point on a ring of virtual nodes; the request goes to the first replica
  clockwise whose load stays within the bound ceil(c x (total load + 1) / N) (Mirrokni, Thorup and
  Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018), so a hot prefix spills over to
  the next replica instead of overloading one.
- cache_aware: the replica holding the longest cached prefix of the request; ties (no replica
  holds any of it, most often) go to the least loaded. When the best-matching replica's load is
  above the same bound, it falls back to the least loaded replica: affinity wins while loads
  are balanced, balance wins once they are not.

Every `choose` also leaves `last_reason` ("affinity", "spill", "least_loaded", "blind"), which the
gateway counts per replica in its metrics.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from typing import Protocol

import xxhash

ROUTING_POLICIES = ("random", "round_robin", "consistent_hash", "cache_aware")
GATEWAY_POLICIES = ("round_robin", "least_loaded", "consistent_hash", "cache_aware")
ALL_POLICIES = ("random", "round_robin", "least_loaded", "consistent_hash", "cache_aware")


class NoReplicaAvailable(RuntimeError):
    """Every replica is out (the gateway answers 503)."""


class ReplicaView(Protocol):
    @property
    def available(self) -> bool:
        """Whether the replica may take requests (healthy)."""

    @property
    def load(self) -> int:
        """Requests the replica is serving now (or has served, in a model without time)."""

    def match_tokens(self, request) -> int:
        """Tokens of `request` this replica's prefix cache holds."""

    @property
    def cached_blocks(self) -> int:
        """Blocks its prefix cache holds (or is believed to hold): a tie-break for new
        prefixes."""


def load_bound(loads: Sequence[int], factor: float, slack: int = 0) -> int:
    """The most load one replica may carry after taking one more request: within `factor`
    of the mean (bounded loads), or within `slack` of the least loaded replica, whichever is
    larger. With `slack` 0 the mean bound is the whole rule (the least loaded replica is
    always below it); a slack keeps affinity at low loads, where one request in flight is
    already above `factor` x the mean but nobody is hot."""
    return max(1, math.ceil(factor * (sum(loads) + 1) / len(loads)), min(loads) + slack)


def least_loaded(loads: Sequence[int], candidates: Sequence[int] | None = None) -> int:
    """Index of the least loaded replica among `candidates` (all by default); ties go to the
    lowest index, so the choice is deterministic."""
    pool = range(len(loads)) if candidates is None else candidates
    return min(pool, key=lambda i: (loads[i], i))


def available_indices(replicas: Sequence[ReplicaView]) -> list[int]:
    """Indices of the replicas that may take a request; raises when there are none."""
    out = [i for i, r in enumerate(replicas) if r.available]
    if not out:
        raise NoReplicaAvailable("no replica is available")
    return out


class RoutingPolicy:
    name = ""
    last_reason = ""

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        raise NotImplementedError


class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        candidates = available_indices(replicas)
        self.last_reason = "blind"
        if len(candidates) == len(replicas):
            return self._rng.randrange(len(replicas))
        return self._rng.choice(candidates)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        available_indices(replicas)
        self.last_reason = "blind"
        while True:
            i = self._next % len(replicas)
            self._next += 1
            if replicas[i].available:
                return i


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        candidates = available_indices(replicas)
        self.last_reason = "least_loaded"
        return least_loaded([r.load for r in replicas], candidates)


class ConsistentHashPolicy(RoutingPolicy):
    name = "consistent_hash"

    def __init__(self, num_replicas: int, block_size: int, key_tokens: int = 256,
                 balance_factor: float = 1.25, vnodes: int = 160, balance_slack: int = 0
                 ) -> None:
        if num_replicas < 1 or balance_factor < 1 or balance_slack < 0:
            raise ValueError("need at least one replica, a balance factor >= 1 and a slack "
                             ">= 0")
        self.key_blocks = max(1, key_tokens // block_size)
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        ring = sorted((xxhash.xxh3_64_intdigest(f"replica-{r}-vnode-{v}".encode()), r)
                      for r in range(num_replicas) for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def key(self, request) -> int | None:
        hashes = request.block_hashes
        if not hashes:
            return None
        return hashes[min(len(hashes), self.key_blocks) - 1] & (2**64 - 1)

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        candidates = available_indices(replicas)
        loads = [r.load for r in replicas]
        key = self.key(request)
        if key is None:  # shorter than a block: nothing to be affine to
            self.last_reason = "least_loaded"
            return least_loaded(loads, candidates)
        bound = load_bound([loads[i] for i in candidates], self.balance_factor,
                           self.balance_slack)
        start = bisect.bisect_left(self._points, key)
        n = len(self._points)
        first = True
        for step in range(n):
            r = self._owners[(start + step) % n]
            if not replicas[r].available:
                continue
            if loads[r] + 1 <= bound:
                self.last_reason = "affinity" if first else "spill"
                return r
            first = False
        self.last_reason = "least_loaded"
        return least_loaded(loads, candidates)


class CacheAwarePolicy(RoutingPolicy):
    """`spread`: a request nobody holds any of goes to the least loaded replica and, among
    equally loaded ones, to the one caching the fewest blocks (SGLang's "smallest tree"), so
    distinct prefixes spread over the replicas even when they are all idle; without it the
    lowest index wins ties (the simulator's rule in docs/planner.md)."""

    name = "cache_aware"

    def __init__(self, balance_factor: float = 1.25, balance_slack: int = 0,
                 spread: bool = False) -> None:
        if balance_factor < 1 or balance_slack < 0:
            raise ValueError("balance factor must be >= 1 and slack >= 0")
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.spread = spread

    def _least_loaded(self, replicas: Sequence[ReplicaView], loads: Sequence[int],
                      candidates: Sequence[int]) -> int:
        if not self.spread:
            return least_loaded(loads, candidates)
        return min(candidates, key=lambda i: (loads[i], replicas[i].cached_blocks, i))

    def choose(self, request, replicas: Sequence[ReplicaView]) -> int:
        candidates = available_indices(replicas)
        loads = [r.load for r in replicas]
        matches = {i: replicas[i].match_tokens(request) for i in candidates}
        best = max(candidates, key=lambda i: (matches[i], -loads[i], -i))
        if matches[best] == 0:
            self.last_reason = "least_loaded"
            return self._least_loaded(replicas, loads, candidates)
        if loads[best] + 1 > load_bound([loads[i] for i in candidates], self.balance_factor,
                                        self.balance_slack):
            self.last_reason = "spill"
            return self._least_loaded(replicas, loads, candidates)
        self.last_reason = "affinity"
        return best


def make_policy(name: str, num_replicas: int, block_size: int, seed: int = 0,
                balance_factor: float = 1.25, key_tokens: int = 256,
                balance_slack: int = 0, spread: bool = False) -> RoutingPolicy:
    if name == "random":
        return RandomPolicy(seed)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "consistent_hash":
        return ConsistentHashPolicy(num_replicas, block_size, key_tokens, balance_factor,
                                    balance_slack=balance_slack)
    if name == "cache_aware":
        return CacheAwarePolicy(balance_factor, balance_slack, spread)
    raise ValueError(f"routing policy must be one of {', '.join(ALL_POLICIES)}, got {name!r}")
