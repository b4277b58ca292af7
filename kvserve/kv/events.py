"""KV events as data: which blocks entered and left the prefix index.

A gateway routing by prefix keeps an approximate picture of each replica's cache; these records
are what lets it correct that picture. The index appends a record when it inserts a block
("BlockStored"), evicts one ("BlockRemoved") or forgets everything ("AllBlocksCleared"), with
vLLM's event names. Nothing is called back: the log is a bounded list that its owner (the engine)
drains after each step and hands to whoever publishes it (the server's /v1/kv_events).

The log is bounded so that an engine nobody drains cannot grow without limit: past `capacity`
records the oldest are dropped and counted, and the next drain reports the loss, so a consumer
knows its picture has a gap and starts over. `capacity=0` turns recording off (the simulator pays
nothing); an engine records into a bounded log whether or not a server drains it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str  # BLOCK_STORED, BLOCK_REMOVED or ALL_BLOCKS_CLEARED
    block_hash: int  # the block's chained hash (kv/hashing.py); 0 for ALL_BLOCKS_CLEARED
    parent_hash: int  # the hash of the block before it (0 for a sequence's first block)


class KVEventLog:
    """A bounded list of `KVEvent`s, drained by its owner."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._events: deque[KVEvent] = deque()
        self._dropped = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def record(self, kind: str, block_hash: int, parent_hash: int) -> None:
        if not self.capacity:
            return
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self._dropped += 1
        self._events.append(KVEvent(kind, block_hash, parent_hash))

    def drain(self) -> tuple[list[KVEvent], int]:
        """The records since the last drain, oldest first, and how many were dropped before
        them for want of room (nonzero: the consumer's picture has a gap)."""
        events, dropped = list(self._events), self._dropped
        self._events.clear()
        self._dropped = 0
        return events, dropped

    def __len__(self) -> int:
        return len(self._events)
