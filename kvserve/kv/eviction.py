"""Eviction policies: which idle cached block goes first. One registry, read by `EngineConfig`,
the CLI and the simulator.

A policy maps a prefix-index node to a heap key (smallest evicted first). The key is taken when a
leaf becomes evictable and stays right until the node is used again (a use locks it; its release
pushes a fresh key), so policies need no bookkeeping of their own.

Equal keys are broken by the index (kv/prefix_index.py), the same way on every run: the
shallower node first (in a windowed cache, the one furthest before the windows; otherwise every
candidate is a leaf), then the one that became evictable first (a counter of heap pushes), so
never by block id, hash or object identity. A policy's key therefore need not be unique.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

NEVER = 2**62


class Candidate(Protocol):
    """What a policy reads of a cached block (a prefix-index node)."""

    block_hash: int
    last_access: int
    hit_count: int
    priority: int


class EvictionPolicy(Protocol):
    name: str
    online: bool  # False: needs the future (a trace), so only the simulator can run it

    def key(self, node: Candidate) -> tuple[int, ...]: ...


class LRU:
    """Least recently used first (vLLM's and SGLang's default)."""

    name, online = "lru", True

    def key(self, node: Candidate) -> tuple[int, ...]:
        return (node.last_access,)


class LFU:
    """Fewest hits first, least recent among equals."""

    name, online = "lfu", True

    def key(self, node: Candidate) -> tuple[int, ...]:
        return (node.hit_count, node.last_access)


class Priority:
    """Lowest request priority first (SGLang's "priority"), least recent among equals."""

    name, online = "priority", True

    def key(self, node: Candidate) -> tuple[int, ...]:
        return (node.priority, node.last_access)


class FutureUses:
    """For each block hash, the trace positions of the requests that would hit it."""

    def __init__(self, uses_per_request: Iterable[Sequence[int]]) -> None:
        self._positions: dict[int, list[int]] = {}
        for pos, hashes in enumerate(uses_per_request):
            for h in hashes:
                lst = self._positions.get(h)
                if lst is None:
                    self._positions[h] = [pos]
                elif lst[-1] != pos:
                    lst.append(pos)

    def next_use(self, block_hash: int, now: int) -> int:
        """The first position >= now that uses the block, or NEVER."""
        lst = self._positions.get(block_hash)
        if not lst:
            return NEVER
        i = bisect.bisect_left(lst, now)
        return lst[i] if i < len(lst) else NEVER


class Belady:
    """The offline reference: the leaf whose next use lies furthest in the future (or never)
    goes first. For one-block requests this is Belady's MIN, optimal for hits; with prefix trees
    it is a heuristic that knows the future, showing how far an online policy is from foresight.
    The simulator sets `now` to the trace position of the request being served."""

    name, online = "belady", False

    def __init__(self, future: FutureUses | None = None) -> None:
        self.future = future or FutureUses(())
        self.now = 0
        # Many leaves share a next use (NEVER, most often): a unique second field keeps the
        # heap from comparing nodes, and among equals evicts the one that went idle first.
        self._tiebreak = itertools.count()

    def key(self, node: Candidate) -> tuple[int, ...]:
        return (-self.future.next_use(node.block_hash, self.now), next(self._tiebreak))


EVICTION_POLICIES: dict[str, type] = {p.name: p for p in (LRU, LFU, Priority, Belady)}
ONLINE_POLICIES = tuple(name for name, p in EVICTION_POLICIES.items() if p.online)


def make_eviction_policy(name: str, online_only: bool = True) -> EvictionPolicy:
    allowed = ONLINE_POLICIES if online_only else tuple(EVICTION_POLICIES)
    if name not in allowed:
        extra = " (belady needs the future: the simulator only)" if name == "belady" else ""
        raise ValueError(f"eviction policy must be one of {', '.join(allowed)}, got {name!r}"
                         + extra)
    return EVICTION_POLICIES[name]()
