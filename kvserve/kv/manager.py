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

The manager's parts, by responsibility: kv/lookup.py (what of a sequence is cached: hashes,
device and tier matches, prefetches), kv/allocation.py (the block tables: allocate, evict,
release, trim, free, reseat), kv/sizes.py (block arithmetic), and here what ties them together:
admission (a hit's blocks and room for the rest, all or nothing), publishing computed blocks
after a step, and the step's memory plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.allocation import BlockAllocation
from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.events import KVEvent, KVEventLog
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.group import Cursor, Group
from kvserve.kv.hashing import extra_keys
from kvserve.kv.invariants import check_manager
from kvserve.kv.lookup import PrefixLookup
from kvserve.kv.pins import Pins
from kvserve.kv.plan import ChunkLoad, StepPlan, SwapOut
from kvserve.kv.prefix_index import Node, NoPrefixCache, PrefixCache, PrefixIndex, PrefixMatch
from kvserve.kv.seq import CachedSeq, tenant_of
from kvserve.kv.swap import SwapMatch
from kvserve.kv.tiers.link import NoTiers, TieredMatch, Tiers
from kvserve.utils import features as F


@dataclass(frozen=True)
class Admission:
    """What admission gave a sequence: its first `num_computed_tokens` are in the cache (device
    hits, copies and tier loads), and room for the tokens asked for is allocated."""

    num_computed_tokens: int



class KVCacheManager(PrefixLookup, BlockAllocation):
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
            Group(w, PrefixIndex(self.pool, block_size, eviction_policy,
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

    def _only_group(self, what: str) -> Group:
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
            g.cursors[seq.request_id] = Cursor(node, match.num_full_blocks, g.index.generation)
        self._count_hits(seq, match)
        grown = self._grow(seq.request_id, match.num_tokens + num_new_tokens)
        assert grown, "can_admit checked the room"
        return Admission(match.num_tokens)

    def _admit_loaded(self, g: Group, seq: CachedSeq, match: TieredMatch, table: list[int],
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

    # -- after a step -----------------------------------------------------------------------
    def cache_full_blocks(self, seq: CachedSeq) -> None:
        """Insert the sequence's newly computed full blocks into each group's prefix index
        (and, under write-through, name their chunks for saving in the next plan)."""
        if not self.prefix_caching:
            return
        for g in self.groups:
            self._publish(g, seq)

    def _publish(self, g: Group, seq: CachedSeq) -> None:
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
