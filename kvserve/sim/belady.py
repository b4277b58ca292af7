"""The offline reference: Belady's rule on the engine's own prefix index.

`BeladyPrefixIndex` is kvserve's `PrefixIndex` with one thing changed, the eviction key: instead of
last access (lru), hit count (lfu) or priority, an idle leaf is keyed by the position in the trace
of the next request that would hit it, and the leaf used furthest in the future (or never) goes
first. The tree, the locking of blocks held by running requests, leaf-only eviction and the heap
are the engine's code, untouched.

Keys are computed when a leaf becomes evictable (as for every policy); a key stays right until the
block is used again, and a use re-pushes it (a hit locks the block; its release pushes a fresh
entry), so no stale key survives. A use of a block is a request whose matchable prefix (its full
prompt blocks, less the last token, which is always computed) contains the block's chained hash.

For requests of one block each ("flat" traces) this is Belady's MIN, optimal for hit count. With
prefix trees it is a heuristic that knows the future (evicting a leaf can only shorten matches
below it); it shows how far an online policy is from what foresight reaches, not a proven bound.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_index import Node, PrefixIndex

NEVER = 2**62


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


class BeladyPrefixIndex(PrefixIndex):
    def __init__(self, pool: BlockPool, block_size: int, future: FutureUses) -> None:
        super().__init__(pool, block_size, "lru")
        self.policy = "belady"
        self.future = future
        self.now = 0  # the position of the next request to be admitted
        # Many leaves share a next use (NEVER, most often): a unique second field keeps the
        # heap from comparing nodes, and among equals evicts the one that went idle first.
        self._tiebreak = itertools.count()

    def _key(self, node: Node) -> tuple[int, ...]:
        return (-self.future.next_use(node.block_hash, self.now), next(self._tiebreak))
