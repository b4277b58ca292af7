"""The gateway's approximate picture of one replica's prefix cache.

A set of block hashes believed cached on the replica, in LRU order and bounded. It is built
from routing history (a request sent to the replica will compute its prompt's blocks there, so
they are added when the replica accepts it) and corrected by the replica's KV events: a
BlockStored confirms a block, a BlockRemoved takes one out, an AllBlocksCleared (or a gap in the
events, or the replica's restart) empties the picture.

Block hashes are chained, so a cached block implies its whole prefix: the match of a request is
the number of its leading hashes found, counted until the first miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixView:
    def __init__(self, capacity_blocks: int = 1_000_000) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` believed cached."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: Iterable[int]) -> None:
        """Blocks now (believed) cached: routed there, or a BlockStored event."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def remove(self, hashes: Iterable[int]) -> None:
        """Blocks the replica evicted (BlockRemoved)."""
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()
