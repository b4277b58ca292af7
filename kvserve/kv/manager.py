"""Per-request block tables over the block pool, with prefix caching and storage tiers.

The manager answers the scheduler's questions — "what of this sequence is cached already?" and
"can it get room for N more tokens?" — and keeps each sequence's block table: block i holds the KV
of token positions [i * block_size, (i + 1) * block_size). Allocation is all-or-nothing, so a
refused sequence holds exactly what it held before.

It touches no KV memory. What a step must do to memory — save evicted chunks to the tiers, load
chunks found there, copy partially matched blocks — is collected in a `StepPlan` that `end_step`
hands to the runner, which executes it before the forward (kv/plan.py says in which order).

It writes no request fields either: it reads a sequence through `CachedSeq` and tells its owner
(the scheduler, or the simulator) what admission gave it.

Memory that follows the window: when every layer has a sliding window (`window`, the largest
one; a Mistral-style model), a sequence that has computed c tokens reads no key before
c - window + 1, so the blocks wholly before that are released (their table entries become
NULL_BLOCK; a published one stays in the prefix index, idle, until evicted), admission counts
only the blocks a sequence holds at once, and a prefix hit needs only the blocks inside the
window at the hit point.

Hybrid models (some layers full, some windowed: Gemma 3, Qwen2 `layer_types`) get one table per
KV group (`group_windows`; kv/spec.py's `page_groups` makes the groups, full ones first): a block
id is one page of one group's layers, every group allocates from the one pool, and each group
applies the rule above with its own window (None: keeps every block). Each group has its own
prefix index over the same block hashes; a hit is the deepest depth valid for every group (a full
group needs blocks 0..d, a windowed one those inside its window at d).

One code path serves G >= 1 groups: every group is handled alike, except where one group can
do more (a partial hit, tier loads, a bounded cache's reseat: one group only, asserted where
it happens) and one fast path for the common one-group `_grow`. `block_tables` is the first
group's tables: the one table of a one-group manager, and for any manager the requests that
hold blocks (every group holds the same ones).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.utils import features as F
from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.events import KVEvent, KVEventLog
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.kv.invariants import check_manager
from kvserve.kv.pins import Pins
from kvserve.kv.plan import ChunkLoad, StepPlan, SwapOut
from kvserve.kv.prefix_index import Node, NoPrefixCache, PrefixCache, PrefixIndex, PrefixMatch
from kvserve.kv.seq import CachedSeq, matchable_tokens, tenant_of
from kvserve.kv.sizes import BlockCounts
from kvserve.kv.swap import SwapMatch
from kvserve.kv.tiers.link import NoTiers, TieredMatch, Tiers


@dataclass(frozen=True)
class Admission:
    """What admission gave a sequence: its first `num_computed_tokens` are in the cache (device
    hits, copies and tier loads), and room for the tokens asked for is allocated."""

    num_computed_tokens: int


@dataclass
class _Cursor:
    """How far a sequence's blocks are in the prefix index: its deepest node, and how many of
    its leading blocks that node's path accounts for."""

    node: Node
    num_blocks: int
    generation: int


@dataclass
class _Group:
    """One KV group's block tables, prefix index and cursors (one group unless hybrid)."""

    window: int | None  # release blocks wholly before it (None: keep every block)
    index: PrefixCache
    tables: dict[str, list[int]]
    cursors: dict[str, _Cursor]


class KVCacheManager(BlockCounts):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str | EvictionPolicy = "lru", tiers: Tiers | None = None,
                 kv_events_capacity: int = 0, window: int | None = None,
                 group_windows: Sequence[int | None] | None = None,
                 track_released: bool = False, max_pinned_fraction: float = 0.5,
                 tenant_quota: float | None = None,
                 max_pinned_total_fraction: float | None = None) -> None:
        """`window`: one table whose every layer has that window (Mistral-style);
        `group_windows`: one table per KV group with these windows (a hybrid layout,
        kv/spec.py's `page_groups`; a block is then one page of one group's layers);
        `track_released`: name the blocks freed since the last plan in each plan's `released`
        (a KV format with per-block state, kv/tensors.py's `keeps_block_state`; else empty);
        `max_pinned_fraction` (each tenant's), `max_pinned_total_fraction` (all tenants'; None:
        the same), `tenant_quota`: kv/pins.py, `set_tenant_quota`."""
        if group_windows is not None and window is not None:
            raise ValueError("give either window (one table) or group_windows, not both")
        windows = tuple(group_windows) if group_windows is not None else (window,)
        if not windows:
            raise ValueError("group_windows must name at least one group")
        for w in windows:
            if w is not None and w < 1:
                raise ValueError(f"a sliding window must be at least 1 token, got {w}")
        has_tiers = tiers is not None and not isinstance(tiers, NoTiers)
        if has_tiers and len(windows) > 1:
            F.refuse(F.HYBRID, F.KV_TIERS)
        if has_tiers and any(w is not None for w in windows):
            F.refuse(F.RELEASED_WINDOW, F.KV_TIERS)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, track_released)
        self.prefix_caching = enable_prefix_caching
        # KV events are the first group's (a full-attention one when hybrid, listed first by
        # page_groups: its index holds a prefix exactly when its blocks are stored).
        self.events = KVEventLog(kv_events_capacity)
        self.groups = [
            _Group(w, PrefixIndex(self.pool, block_size, eviction_policy,
                                  self.events if g == 0 else KVEventLog(0), w)
                   if enable_prefix_caching else NoPrefixCache(block_size), {}, {})
            for g, w in enumerate(windows)]
        # Read by the scheduler once per running request and step (`block_table`): a plain
        # attribute, not a property.
        self.block_tables: dict[str, list[int]] = self.groups[0].tables
        self._windowed = any(g.window is not None for g in self.groups)
        self.tiers: Tiers = tiers if tiers is not None else NoTiers()
        self._plan = StepPlan()
        self._copy_sources: list[int] = []  # locked until the plan that copies them is handed out
        self.prefix_cache_queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # tokens served from cache
        self.hit_tokens: Counter[str] = Counter()  # by source: device, host, disk, remote
        self.pins = Pins(self)  # prefixes held on the device until unpinned (kv/pins.py)
        self.pins.set_max_fraction(max_pinned_fraction, max_pinned_total_fraction)
        if tenant_quota is not None:
            self.set_tenant_quota(tenant_quota)

    def set_tenant_quota(self, fraction: float) -> None:
        """Bound each tenant's idle cached blocks to `fraction` of the pool (kv/prefix_index)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_tenant_quota must be in (0, 1], got {fraction}")
        for g in self.groups:
            if isinstance(g.index, PrefixIndex):
                g.index.set_tenant_quota(int(fraction * self.num_blocks))

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _only_group(self, what: str) -> _Group:
        if len(self.groups) != 1:
            raise ValueError(f"{what} belongs to one group of {len(self.groups)}: read "
                             "manager.groups[g] of a hybrid manager")
        return self.groups[0]

    @property
    def index(self) -> PrefixCache:
        """The prefix index of a one-group manager (`groups[g].index` for each of several)."""
        return self._only_group("the prefix index").index

    @property
    def window(self) -> int | None:
        """The window of a one-group manager (`groups[g].window` for each of several)."""
        return self._only_group("the window").window

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can count on: free plus evictable cached ones."""
        return self.pool.num_available

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks evicted from the prefix cache, every group's index together."""
        return sum(g.index.num_evicted_blocks for g in self.groups)

    def _hit_start(self, num_nodes: int, num_tokens: int, group: int) -> int:
        """The first block of a hit that admission holds in a group: the window's at the hit
        point, but never past the last matched block (new blocks are published under its
        node, so it must stay in the index)."""
        return min(self.first_held_block(num_tokens, group=group), max(num_nodes - 1, 0))

    # -- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, seq: CachedSeq, num_blocks: int) -> list[int]:
        """The sequence's chained block hashes, extended on demand to `num_blocks` full blocks."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else 0
            hashes.extend(chain_hashes(seq.token_ids[: num_blocks * self.block_size],
                                       self.block_size, extra_keys(seq.cache_salt), parent,
                                       start_block=len(hashes)))
        return hashes[:num_blocks]

    def _matchable_hashes(self, seq: CachedSeq) -> list[int]:
        return self.block_hashes(seq, matchable_tokens(seq) // self.block_size)

    def device_match(self, seq: CachedSeq) -> PrefixMatch:
        """The longest prefix of a sequence that device blocks hold (in every group)."""
        limit = matchable_tokens(seq)
        if limit == 0 or not self.prefix_caching:
            return PrefixMatch([], block_size=self.block_size)
        tokens, hashes = seq.token_ids[:limit], self._matchable_hashes(seq)
        extra = extra_keys(seq.cache_salt)
        indexes: list[PrefixIndex] = [g.index for g in self.groups]  # type: ignore[misc]
        if len(indexes) == 1:  # one index can also serve a partial hit (a copy-on-write)
            return indexes[0].match(tokens, hashes, extra)
        # Each group's path, and the deepest depth every group can serve. No partial hit (a
        # copy would be needed in every group at once).
        paths = [index.walk(tokens, hashes, extra) for index in indexes]
        valid = [index.valid_depths(p) for index, p in zip(indexes, paths)]
        depth = max(d for d in range(min(len(p) for p in paths) + 1)
                    if all(v[d] for v in valid))
        return PrefixMatch(paths[0][:depth], block_size=self.block_size,
                           group_nodes=[p[:depth] for p in paths])

    def match(self, seq: CachedSeq) -> PrefixMatch:
        """The longest cached prefix of a sequence that holds no blocks: device blocks, then
        chunks in host memory."""
        match = self.device_match(seq)
        if matchable_tokens(seq) == 0 or not self.prefix_caching:
            return match
        return self.tiers.continue_match(match, self._matchable_hashes(seq))

    def match_after_prefetch(self, seq: CachedSeq) -> PrefixMatch:
        """`match` as the sequence would find it once a prefetch of its chunks on disk or in
        Redis were done, without doing one (read-only: the cache report's explain)."""
        match = self.device_match(seq)
        if matchable_tokens(seq) == 0 or not self.prefix_caching:
            return match
        return self.tiers.match_after_prefetch(match, self._matchable_hashes(seq))

    def hashes_completed_by(self, seq: CachedSeq, num_new_tokens: int) -> list[int]:
        """Hashes of the full blocks that computing `num_new_tokens` more of `seq` completes (the
        scheduler lets a request whose next block is among them wait a step and hit it)."""
        if not self.prefix_caching:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        return self.block_hashes(seq, last)[first:] if last > first else []

    def next_block_hash(self, seq: CachedSeq, match: PrefixMatch) -> int | None:
        """The hash of the first matchable block that `match` does not cover, if any."""
        hashes = self._matchable_hashes(seq) if self.prefix_caching else []
        j = match.num_full_blocks
        return hashes[j] if j < len(hashes) else None

    def start_prefetch(self, seq: CachedSeq, peer: str | None = None) -> None:
        """Begin promoting the sequence's chunks from disk/Redis (and `peer`, the instance
        that computed its prompt) into host memory."""
        if matchable_tokens(seq) and self.prefix_caching:
            self.tiers.start_prefetch(seq.request_id, self._matchable_hashes(seq),
                                      len(self.device_match(seq).nodes), peer)

    def prefetch_pending(self, seq: CachedSeq) -> bool:
        return self.tiers.prefetch_pending(seq.request_id)

    def wait_for_prefetch(self, seconds: float) -> bool:
        """Block up to `seconds` for a pending prefetch (an engine with nothing else to do);
        True if there was one."""
        return self.tiers.wait_for_prefetch(seconds)

    # -- admission --------------------------------------------------------------------------
    def _group_hits(self, match: PrefixMatch) -> list[tuple[int, list[Node]]]:
        """Per group: the first block of the hit that admission holds, and the matched nodes."""
        nodes = match.group_nodes
        if nodes is None:  # a one-index match (one group), or no hit at all
            assert len(self.groups) == 1 or not match.nodes, "a hybrid hit without its groups"
            nodes = [match.nodes] + [[] for _ in range(len(self.groups) - 1)]
        assert len(nodes) == len(self.groups), "a match from a manager of other groups"
        return [(self._hit_start(len(n), match.num_tokens, g), n) for g, n in enumerate(nodes)]

    def can_admit(self, match: PrefixMatch, num_tokens: int, total_tokens: int | None = None
                  ) -> bool:
        """Whether the pool can hold `num_tokens` of a sequence (with a partially matched block
        locked until the plan that copies it is handed out) and, if given, `total_tokens` once
        the copy is done; every group's blocks together."""
        pool = self.pool
        taken = need_now = need_total = 0
        finals = self.group_final_blocks(total_tokens) if total_tokens is not None else None
        for g, (first, nodes) in enumerate(self._group_hits(match)):
            kept = [n.block for n in nodes[first:]]  # a windowed hit drops blocks before its window
            taken += sum(1 for b in kept if pool.ref_counts[b] == 0)  # stop being evictable
            span = self.blocks_for_tokens(num_tokens) - first  # the table's entries from `first` on
            need_now += span - len(kept)
            if finals is not None:
                # Blocks of the hit released later go back to the pool, so `kept` counts once.
                need_total += max(span, finals[g]) - len(kept)
        source = int(match.partial is not None and pool.ref_counts[match.partial.block] == 0)
        room = pool.num_available - taken
        if need_now > room - source:
            return False
        return finals is None or need_total <= room

    def unblock(self, match: PrefixMatch, num_tokens: int, total_tokens: int | None = None
                ) -> PrefixMatch | None:
        """For a pool that nothing running will free: the match less its partial hit, when the
        idle block that hit would copy from is the one block the pool lacks (computing that
        block instead fits); None if that does not help either. Without it such a sequence
        would wait forever."""
        if match.partial is None or self.can_admit(match, num_tokens, total_tokens):
            return None
        plain = match.without_partial()
        return plain if self.can_admit(plain, num_tokens, total_tokens) else None

    def admit(self, seq: CachedSeq, match: PrefixMatch, num_new_tokens: int,
              total_tokens: int | None = None) -> Admission | None:
        """Give a waiting sequence its cached prefix and room for `num_new_tokens` more, if the
        pool can also hold the rest of its tokens (and `total_tokens`, when the caller reserves
        more); otherwise change nothing and return None."""
        assert seq.request_id not in self.block_tables
        if not self.can_admit(match, len(seq.token_ids), total_tokens):
            return None
        loaded, swapped = isinstance(match, TieredMatch), isinstance(match, SwapMatch)
        for g, (first, nodes) in zip(self.groups, self._group_hits(match)):
            blocks = [n.block for n in nodes[first:]]
            self.pool.share(blocks)
            table = [NULL_BLOCK] * first + blocks
            node = nodes[-1] if nodes else g.index.root(extra_keys(seq.cache_salt))
            if loaded or swapped or match.partial is not None:
                # Only a one-group manager gets these (tiers and swaps refuse per-group tables;
                # a hybrid match has no partial hit).
                assert len(self.groups) == 1, "loads or a partial hit under several groups"
                if loaded:
                    node = self._admit_loaded(g, seq, match, table, node)
                elif swapped:  # published after the step, as if computed (the cursor is here)
                    table.extend(self._load_blocks(match.num_loaded_blocks, match.data))
                else:
                    self.pool.share([match.partial.block])  # locked until the plan is handed out
                    self._copy_sources.append(match.partial.block)
                    copy = self.allocate_blocks(1)[0]
                    self._plan.copies.append((match.partial.block, copy))
                    table.append(copy)
            g.tables[seq.request_id] = table
            g.index.touch(nodes, seq.priority)
            g.cursors[seq.request_id] = _Cursor(node, match.num_full_blocks, g.index.generation)
        self._count_hits(seq, match)
        grown = self._grow(seq.request_id, match.num_tokens + num_new_tokens)
        assert grown, "can_admit checked the room"
        return Admission(match.num_tokens)

    def _admit_loaded(self, g: _Group, seq: CachedSeq, match: TieredMatch, table: list[int],
                      node: Node) -> Node:
        """Fresh blocks for the chunks found in host memory: their KV goes into the plan, and
        they enter the index like computed blocks (nothing reads them before the plan's loads
        have run); returns the deepest node."""
        blocks = self._load_blocks(match.num_loaded_blocks, self.tiers.loaded_kv(match))
        first = len(table)
        table.extend(blocks)
        hashes = self.block_hashes(seq, first + len(blocks))
        bs, tenant = self.block_size, tenant_of(seq)
        for i in range(first, first + len(blocks)):
            node = g.index.insert(node, seq.token_ids[i * bs:(i + 1) * bs], hashes[i],
                                  table[i], seq.priority, tenant)
            assert node.block == table[i], "a loaded chunk is on the device already"
        self.tiers.consumed(match.chunks)
        return node

    def _load_blocks(self, n: int, data) -> list[int]:
        """Fresh blocks whose KV (tier chunks, swapped KV) the plan loads before the forward."""
        blocks = self.allocate_blocks(n)
        self._plan.loads.append(ChunkLoad(tuple(blocks), data))
        return blocks

    def plan_swap_out(self, out: SwapOut) -> None:
        """Read a preempted sequence's blocks out in the next plan (kv/swap.py)."""
        self._plan.swap_outs.append(out)

    def _count_hits(self, seq: CachedSeq, match: PrefixMatch) -> None:
        if seq.skip_reading_prefix_cache:  # not a query (vLLM counts none for such requests)
            return
        self.prefix_cache_queries += len(seq.token_ids)
        self.prefix_cache_hits += match.num_full_blocks * self.block_size + match.partial_len
        self.hit_tokens["device"] += len(match.nodes) * self.block_size + match.partial_len
        if isinstance(match, TieredMatch):
            for source, tokens in self.tiers.tokens_by_source(match):
                self.hit_tokens[source] += tokens

    # -- allocation -------------------------------------------------------------------------
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

    # -- after a step -----------------------------------------------------------------------
    def cache_full_blocks(self, seq: CachedSeq) -> None:
        """Insert the sequence's newly computed full blocks into each group's prefix index
        (and, under write-through, name their chunks for saving in the next plan)."""
        if not self.prefix_caching:
            return
        for g in self.groups:
            self._publish(g, seq)

    def _publish(self, g: _Group, seq: CachedSeq) -> None:
        cursor = g.cursors.get(seq.request_id)
        if cursor is None:
            return
        if cursor.generation != g.index.generation or cursor.node.dropped:  # reset or dropped
            del g.cursors[seq.request_id]
            return
        full = seq.num_computed_tokens // self.block_size
        limit = getattr(seq, "publish_limit", None)  # document reuse: blended KV stays out
        if limit is not None:
            full = min(full, limit // self.block_size)
        if full <= cursor.num_blocks:
            return
        hashes = self.block_hashes(seq, full)
        table = g.tables[seq.request_id]
        bs, tenant = self.block_size, tenant_of(seq)
        node = cursor.node
        for i in range(cursor.num_blocks, full):
            assert table[i] != NULL_BLOCK, "a block is released before it is published"
            node = g.index.insert(node, seq.token_ids[i * bs:(i + 1) * bs], hashes[i],
                                  table[i], seq.priority, tenant)
            if node.block != table[i]:
                # The index holds this content already (computed twice at once, or a
                # copy-on-write block that ended up equal to its source): switch to the cached
                # block and free the duplicate. A sequence must hold every node on its path: an
                # idle node above a held one could not be evicted though the pool counts it as
                # available, and the cursor node could be evicted under the sequence.
                self.pool.share([node.block])
                g.index.mark_idle(self.pool.release([table[i]]))
                table[i] = node.block
        self._plan.saves.extend(self.tiers.saves_for_computed(table, hashes, cursor.num_blocks,
                                                              full))
        cursor.node = node
        cursor.num_blocks = full

    def end_step(self) -> StepPlan:
        """Hand out what this step must do to KV memory, and start the next plan.

        The plan is executed before anything can allocate again (the runner runs it before the
        forward, and the next step schedules after that), so the sources of its copies can be let
        go now: nothing can evict and reuse them before they are read.
        """
        plan, self._plan = self._plan, StepPlan()
        if self._copy_sources:  # partial hits: one group
            self._only_group("a copy-on-write").index.mark_idle(
                self.pool.release(self._copy_sources))
            self._copy_sources = []
        if self.pool.track_released:
            plan.released = self.pool.take_released()
        return plan

    def reset_prefix_cache(self) -> None:
        self.pins.clear()
        for g in self.groups:
            g.index.reset()

    def drain_events(self) -> tuple[list[KVEvent], int]:
        """Blocks stored in and removed from the prefix index since the last drain (recorded
        when the manager was built with `kv_events_capacity`), and how many were dropped: the
        first group's (`events`)."""
        return self.events.drain()

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self, seqs: Sequence[CachedSeq]) -> None:
        """Tables belong to live sequences, cover their computed tokens (every block a query can
        still read is held: a released one is never read), and match the pool (kv/invariants)."""
        check_manager(self, seqs)
