"""A bounded record of recently evicted block hashes, kept by the prefix index for the cache
report's `evicted` reason (kvserve/kv/report.py)."""

from __future__ import annotations

from collections import OrderedDict


class EvictionRecord:
    """Recently evicted block hashes -> (time, policy, pool usage then): a bounded LRU map,
    O(1) per eviction, filled by the prefix index's `evict`."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[float, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, block_hash: int, stamp: tuple[float, str, float]) -> None:
        """`stamp`: (time.time(), policy name, pool usage) of the eviction."""
        entries = self._entries
        entries[block_hash] = stamp
        entries.move_to_end(block_hash)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def get(self, block_hash: int) -> tuple[float, str, float] | None:
        return self._entries.get(block_hash)

    def clear(self) -> None:
        self._entries.clear()
