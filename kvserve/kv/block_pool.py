"""Physical KV blocks: ids, ref counts, the free list, and which blocks the prefix index names.

A block id indexes the KV tensor pool (kv/tensors.py). Its ref count is the number of requests
whose block table holds it. A block with ref count 0 is either free (on the free list, content
meaningless) or cached-idle: the prefix index still names it and a later request may hit it, but
the manager may ask the index to evict it whenever fresh blocks are needed. So the blocks an
allocation can count on are `num_free + num_cached_idle`. The pool calls nobody: eviction is asked
for top-down by the manager, and `release` returns the blocks that turned idle.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


# A block table's entry for a position range whose KV the sequence no longer holds: a windowed
# layer's blocks wholly before its window are released (vLLM's null block). Attention never reads
# such an entry (a query at q reads no key before q - window + 1).
NULL_BLOCK = -1


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more free blocks than there are; callers check first."""


class BlockPool:
    def __init__(self, num_blocks: int, track_released: bool = False) -> None:
        """`track_released`: record the blocks whose last holder lets go (`take_released`),
        for a KV format that keeps state per block; off, that costs nothing."""
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks  # named by the prefix index
        self.num_cached_idle = 0  # cached with ref count 0: evictable
        self._free: deque[int] = deque(range(num_blocks))
        # Blocks whose last holder let go since `take_released` (for the step plan's
        # `released`: the worker drops per-block state it keeps beside their KV).
        self._released: list[int] = []
        self.track_released = track_released
        # Tenant quotas (`track_tenants`): each cached block's tenant, and idle cached blocks
        # per tenant, kept where the idle count itself is; None: off, and free.
        self.tenant_of: list[str] | None = None
        self.idle_by_tenant: Counter[str] = Counter()

    def track_tenants(self) -> None:
        if self.tenant_of is None:
            if any(self.cached):
                raise ValueError("tenant quotas must be set before anything is cached")
            self.tenant_of = [""] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus idle cached ones that may be evicted."""
        return len(self._free) + self.num_cached_idle

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc, as 0..1); idle
        cached blocks count as free, since any allocation may take them."""
        return 1.0 - self.num_available / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free list (the manager evicts first when it is short)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a holder to blocks that are held or cached (a prefix-cache hit)."""
        for b in blocks:
            count = self.ref_counts[b]
            if count == 0:
                if not self.cached[b]:
                    raise ValueError(f"block {b} is free and cannot be shared")
                self.num_cached_idle -= 1
                if self.tenant_of is not None:
                    self.idle_by_tenant[self.tenant_of[b]] -= 1
            self.ref_counts[b] = count + 1

    def release(self, blocks: Iterable[int]) -> list[int]:
        """Drop one holder from each block; at zero a cached block turns idle (returned, so the
        index can make it evictable), others go back to the free list.

        Blocks are released in reverse so that the tail of a sequence, the part least likely to be
        shared, goes back first and is reused first.
        """
        idle = []
        for b in reversed(list(blocks)):
            count = self.ref_counts[b]
            if count <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self.ref_counts[b] = count - 1
            if count > 1:
                continue
            if self.track_released:
                self._released.append(b)
            if self.cached[b]:
                self.num_cached_idle += 1
                if self.tenant_of is not None:
                    self.idle_by_tenant[self.tenant_of[b]] += 1
                idle.append(b)
            else:
                self._free.append(b)
        return idle

    def take_released(self) -> list[int]:
        released, self._released = self._released, []
        return released

    def mark_cached(self, block: int, tenant: str = "") -> None:
        """The prefix index names a held block (of `tenant`, for quotas)."""
        if self.ref_counts[block] <= 0 or self.cached[block]:
            raise ValueError(f"block {block} cannot be cached (free or cached already)")
        self.cached[block] = True
        if self.tenant_of is not None:
            self.tenant_of[block] = tenant

    def uncache(self, block: int) -> None:
        """The prefix index forgets a block: an idle one goes to the free list."""
        if not self.cached[block]:
            raise ValueError(f"block {block} is not cached")
        self.cached[block] = False
        if self.ref_counts[block] == 0:
            self.num_cached_idle -= 1
            if self.tenant_of is not None:
                self.idle_by_tenant[self.tenant_of[block]] -= 1
            self._free.append(block)

    def check_invariants(self, holders: Iterable[Iterable[int]] = ()) -> None:
        """Ref counts equal the number of holders; free list = exactly the unheld, uncached
        blocks; the idle count matches."""
        expected = [0] * self.num_blocks
        for table in holders:
            for b in table:
                expected[b] += 1
        assert expected == self.ref_counts, "ref counts disagree with the block tables"
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        unheld = {b for b, c in enumerate(self.ref_counts) if c == 0}
        assert set(free) == {b for b in unheld if not self.cached[b]}, \
            "free list disagrees with ref counts"
        assert self.num_cached_idle == sum(1 for b in unheld if self.cached[b]), \
            "idle cached count is off"
        if self.tenant_of is not None:
            per = Counter(self.tenant_of[b] for b in unheld if self.cached[b])
            assert {t: c for t, c in self.idle_by_tenant.items() if c} == per, \
                "idle cached blocks per tenant are off"
