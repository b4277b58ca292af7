"""The manager's block tables (kv/manager.py inherits them): taking blocks (evicting idle cached
ones, windowed groups first), growing a sequence's tables, releasing what falls out of its
window, trimming rejected drafts, freeing a sequence, reseating a bounded one. Every release goes
through the pool and marks the index's nodes idle, here only."""

from __future__ import annotations

from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.group import Group
from kvserve.kv.plan import StepPlan
from kvserve.kv.prefix_index import Node
from kvserve.kv.seq import CachedSeq
from kvserve.kv.sizes import BlockCounts
from kvserve.kv.tiers.link import Tiers
from kvserve.utils import features as F


class BlockAllocation(BlockCounts):
    """Needs `pool`, `groups`, `block_tables` (the first group's), `tiers`, `_plan` and
    `_windowed` (set by the manager)."""

    pool: BlockPool
    groups: list[Group]
    block_tables: dict[str, list[int]]
    tiers: Tiers
    _plan: StepPlan
    _windowed: bool

    def allocate_blocks(self, n: int) -> list[int]:
        """Take `n` blocks, evicting idle cached ones first if the free list is short; a
        chunk an eviction ends is named in the plan, to be saved before the block is reused."""
        short = n - self.pool.num_free
        if short > 0:
            for node in self._evict(short):
                save = self.tiers.save_for_evicted(node)
                if save is not None:
                    self._plan.saves.append(save)
        return self.pool.allocate(n)

    def _evict(self, n: int) -> list[Node]:
        """Up to `n` idle blocks out of the indexes. With several groups, windowed groups give
        first, a share from each in turn (each index in its own policy order: LRU hollows the
        oldest, shallowest entries, which no deep hit needs), and full groups only when they
        have nothing left: a full group can only drop a path's deepest blocks, which shortens
        every hit through it, and a hit needs every group."""
        out: list[Node] = []
        windowed = [g for g in self.groups if g.window is not None]
        full = [g for g in self.groups if g.window is None]
        for tier in (windowed, full):
            while len(out) < n and tier:
                before = len(out)
                for g in tier:
                    if len(out) >= n:
                        break
                    out.extend(g.index.evict(max(1, (n - len(out)) // len(tier))))
                if len(out) == before:
                    break
        return out

    def _release_outside_window(self, seq: CachedSeq) -> None:
        """Release the blocks wholly before the sequence's window, in each windowed group: no
        query reads them again (a preempted sequence recomputes from the start). Published
        ones stay cached, idle."""
        for i, g in enumerate(self.groups):
            if g.window is None:
                continue
            table = g.tables.get(seq.request_id)
            end = self.first_held_block(seq.num_computed_tokens, group=i)
            cursor = g.cursors.get(seq.request_id)
            if cursor is not None and cursor.num_blocks:
                # Keep the last published block: the next ones are published under its node.
                end = min(end, cursor.num_blocks - 1)
            # Released entries are always a prefix of the table (check_invariants): only the
            # run between the last released one and `end` is new, not the whole history.
            if not table or end <= 0 or table[end - 1] == NULL_BLOCK:
                continue
            start = end - 1
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            gone = table[start:end]
            table[start:end] = [NULL_BLOCK] * (end - start)
            g.index.mark_idle(self.pool.release(gone))

    def _grow(self, request_id: str, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size)  # blocks_for_tokens, once per sequence a step
        if len(self.groups) == 1:  # the common case, once per running sequence per step
            table = self.block_tables.setdefault(request_id, [])
            missing = need - len(table)
            if missing <= 0:
                return True
            if missing > self.pool.num_available:
                return False
            table.extend(self.allocate_blocks(missing))
            return True
        missing = [need - len(g.tables.get(request_id, ())) for g in self.groups]
        if sum(missing) > self.pool.num_available:
            return False
        for g, m in zip(self.groups, missing):
            table = g.tables.setdefault(request_id, [])
            if m > 0:
                table.extend(self.allocate_blocks(m))
        return True

    def allocate_slots(self, seq: CachedSeq, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change, beyond releasing
        blocks that fell out of the window) if the pool is short."""
        if self._windowed:
            self._release_outside_window(seq)
        return self._grow(seq.request_id,  # kv_length(seq), inline: every sequence, every step
                          seq.num_computed_tokens - seq.num_dropped_tokens + num_new_tokens)

    def trim(self, seq: CachedSeq, num_tokens: int) -> None:
        """Give back the blocks wholly past the sequence's first `num_tokens` (speculative
        decoding: the slots of rejected drafts; never published, so they go straight back)."""
        keep = self.blocks_for_tokens(num_tokens - seq.num_dropped_tokens)
        for g in self.groups:
            table = g.tables.get(seq.request_id)
            if table is not None and len(table) > keep:
                gone = table[keep:]
                del table[keep:]
                g.index.mark_idle(self.pool.release(gone))

    def free(self, seq: CachedSeq) -> None:
        """Give back every block of a finished, aborted or preempted sequence; cached blocks stay
        in the index, idle, until evicted."""
        self.tiers.forget(seq.request_id)
        for g in self.groups:
            g.cursors.pop(seq.request_id, None)
            table = g.tables.pop(seq.request_id, None)
            if table:
                g.index.mark_idle(self.pool.release(b for b in table if b != NULL_BLOCK))

    def reseat(self, seq: CachedSeq, num_blocks: int) -> tuple[list[int], list[int]] | None:
        """Move a bounded sequence (kvserve.kv.bounded) onto `num_blocks` fresh private blocks,
        for its compacted KV: returns (old table, new table), or None (no change) if the pool
        lacks the blocks. The old blocks are released at once (cached ones stay in the index,
        idle) but keep their KV until the next allocation, so the caller copies the kept tokens
        out of them before anything allocates. The sequence inserts nothing more into the
        prefix index: its blocks no longer hold the KV their tokens' hashes name."""
        if len(self.groups) > 1:
            F.refuse(F.BOUNDED, F.HYBRID)
        [g] = self.groups
        if num_blocks > self.pool.num_available:
            return None
        fresh = self.allocate_blocks(num_blocks)
        old = g.tables[seq.request_id]
        g.tables[seq.request_id] = fresh
        g.cursors.pop(seq.request_id, None)
        g.index.mark_idle(self.pool.release([b for b in old if b != NULL_BLOCK]))
        return old, fresh

    def block_table(self, seq: CachedSeq) -> list[int]:
        """The first group's table: the one table of a one-group manager (the scheduler's
        common case; `group_block_tables` for every group)."""
        return self.block_tables[seq.request_id]

    def group_block_tables(self, seq: CachedSeq) -> list[list[int]]:
        """Every group's table, in group order."""
        return [g.tables[seq.request_id] for g in self.groups]
