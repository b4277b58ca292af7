"""Physical KV blocks: who owns them and which are free.

A block is an index into the per-layer K/V tensors. The pool only counts references; it does not
know about requests or tokens. A block with ref count 0 is on the free list; sharing a block (a
prefix used by several requests) is one more reference, and the block returns to the free list
when the last holder releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free; callers check first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # FIFO reuse: a freed block is taken again as late as possible, which keeps freed content
        # around longest for whoever may want to find it again (prefix caching builds on this).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by someone (vLLM's kv_cache_usage_perc, as 0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a holder to blocks that are already in use."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one holder from each block; the last release frees it.

        Blocks are released in reverse so that the tail of a sequence, the part least likely to be
        shared, goes back to the free list first and is reused first.
        """
        for b in reversed(list(blocks)):
            count = self.ref_counts[b]
            if count <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self.ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)

    def check_invariants(self, holders: Iterable[Iterable[int]] = ()) -> None:
        """Ref counts equal the number of holders; free list = exactly the unheld blocks."""
        expected = [0] * self.num_blocks
        for table in holders:
            for b in table:
                expected[b] += 1
        assert expected == self.ref_counts, "ref counts disagree with the block tables"
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert set(free) == {b for b, c in enumerate(self.ref_counts) if c == 0}, \
            "free list disagrees with ref counts"
