"""Per-request block tables over the block pool, with prefix caching.

The manager answers the scheduler's questions, "what of this request is cached already?" and
"can it get room for N more tokens?", and keeps each request's block table: block i holds the KV of
token positions [i * block_size, (i + 1) * block_size). Allocation is all-or-nothing, so a refused
request holds exactly what it held before.

With prefix caching, admission shares the matched blocks (one more reference each) and, for a
match that ends inside a block, copies that block into a fresh one (copy-on-write: the runner
performs the copy before the next forward, and the source stays locked until then). After every
step, the request's newly completed full blocks are inserted into the prefix index, so a request
that arrives a step later can hit them while their writer is still running.

With storage tiers attached (kv/tiers/link.py does the chunk-level work), evicted chunks are
saved below, and a match that ends on the device goes on through the chunks in host memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.kv.prefix_index import Node, PrefixIndex, PrefixMatch
from kvserve.request import Request

from kvserve.kv.tiers.link import CacheMatch, TierLink

if TYPE_CHECKING:
    from kvserve.kv.tiers.tiered import TieredKVStore
    from kvserve.model.attention.base import AttentionBackend


@dataclass
class _Cursor:
    """How far a request's blocks are in the prefix index: its deepest node, and how many of
    its leading blocks that node's path accounts for."""

    node: Node
    num_blocks: int
    generation: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru") -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex(self.pool, block_size, eviction_policy) \
            if enable_prefix_caching else None
        self.block_tables: dict[str, list[int]] = {}
        self._cursors: dict[str, _Cursor] = {}
        self._pending_copies: list[tuple[int, int]] = []  # (source, destination)
        self.prefix_cache_queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # tokens served from cache
        self.hit_tokens = Counter()  # by source: device, host, disk, remote
        self.tier_link: TierLink | None = None

    # -- storage tiers ----------------------------------------------------------------------
    def attach_tiers(self, tiers: "TieredKVStore", kv_io: "AttentionBackend") -> None:
        """Save evicted chunks to these tiers and load hits from them."""
        self.tier_link = TierLink(self, tiers, kv_io)

    def detach_tiers(self) -> None:
        if self.tier_link is not None:
            self.tier_link.close()
            self.tier_link = None

    def start_prefetch(self, request: Request) -> None:
        """Begin promoting the request's chunks from disk/Redis into host memory."""
        if self.tier_link is not None:
            self.tier_link.start_prefetch(request)

    def prefetch_pending(self, request: Request) -> bool:
        return self.tier_link is not None and self.tier_link.prefetch_pending(request)

    def wait_for_prefetch(self, seconds: float) -> bool:
        """Block up to `seconds` for a pending prefetch (an engine with nothing else to do);
        True if there was one."""
        return self.tier_link is not None and self.tier_link.wait_for_prefetch(seconds)

    def apply_pending_loads(self, write_blocks: Callable[[list[int], torch.Tensor], None]) -> None:
        """Write the KV of chunks loaded from the tiers into their blocks (before a forward, and
        before the copy-on-write copies, which may read them)."""
        if self.tier_link is not None:
            self.tier_link.apply_pending_loads(write_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can count on: free plus evictable cached ones."""
        return self.pool.num_available

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's chained block hashes, extended on demand to `num_blocks` full blocks."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else 0
            hashes.extend(chain_hashes(request.token_ids[: num_blocks * self.block_size],
                                       self.block_size, extra_keys(request.cache_salt), parent,
                                       start_block=len(hashes)))
        return hashes[:num_blocks]

    def match(self, request: Request) -> PrefixMatch:
        """Longest cached prefix of a request that holds no blocks; the last token is always
        left to compute, since its logits are needed."""
        limit = request.num_tokens - 1
        if self.index is None or limit <= 0:
            return PrefixMatch([], block_size=self.block_size)
        tokens = request.token_ids[:limit]
        match = self.index.match(tokens, self.block_hashes(request, limit // self.block_size),
                                 extra_keys(request.cache_salt))
        return match if self.tier_link is None else self.tier_link.continue_match(request, match)

    def admit(self, request: Request, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Give a waiting request its cached prefix and room for `num_new_tokens` more, if the pool
        can also hold the rest of its tokens later; otherwise change nothing and return False."""
        assert request.request_id not in self.block_tables
        # Blocks the match uses stop being evictable once shared: they are not extra room.
        idle_hits = sum(1 for b in match.blocks if self.pool.ref_counts[b] == 0)
        if match.partial is not None and self.pool.ref_counts[match.partial.block] == 0:
            idle_hits += 1
        need = self.blocks_for_tokens(request.num_tokens) - len(match.nodes)
        if need > self.pool.num_available - idle_hits:
            return False
        self.pool.share(match.blocks)
        table = list(match.blocks)
        node = match.last_node
        if isinstance(match, CacheMatch):
            assert self.tier_link is not None
            node = self.tier_link.admit_loaded(request, match, table)
        elif match.partial is not None:
            self.pool.share([match.partial.block])  # locked until the copy is done
            copy = self.pool.allocate(1)[0]
            self._pending_copies.append((match.partial.block, copy))
            table.append(copy)
        self.block_tables[request.request_id] = table
        request.num_computed_tokens = match.num_tokens
        if request.num_preemptions == 0:  # a resumed request hitting its own blocks is no news
            request.num_cached_tokens = match.num_tokens
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += match.num_tokens
        self.hit_tokens["device"] += len(match.nodes) * self.block_size + match.partial_len
        if self.index is not None:
            self.index.touch(match.nodes, request.priority)
            root = self.index.root(extra_keys(request.cache_salt))
            self._cursors[request.request_id] = _Cursor(node or root, match.num_full_blocks,
                                                        self.index.generation)
        ok = self.allocate_slots(request, num_new_tokens)
        assert ok, "admission checked the room"
        return True

    def apply_pending_copies(self, copy_blocks: Callable[[list[int], list[int]], None]) -> None:
        """Perform the copy-on-write copies queued by admissions, then unlock their sources.

        Call it after `apply_pending_loads`: a source may be a block loaded from a tier in this
        very step (it entered the index at its admission), whose KV is written by the load."""
        if not self._pending_copies:
            return
        src = [s for s, _ in self._pending_copies]
        dst = [d for _, d in self._pending_copies]
        self._pending_copies = []
        copy_blocks(src, dst)
        self.pool.release(src)

    def cache_full_blocks(self, request: Request) -> None:
        """Insert the request's newly computed full blocks into the prefix index."""
        cursor = self._cursors.get(request.request_id)
        if cursor is None or self.index is None:
            return
        if cursor.generation != self.index.generation:  # the cache was reset under it
            del self._cursors[request.request_id]
            return
        full = request.num_computed_tokens // self.block_size
        if full <= cursor.num_blocks:
            return
        hashes = self.block_hashes(request, full)
        table = self.block_tables[request.request_id]
        bs = self.block_size
        node = cursor.node
        for i in range(cursor.num_blocks, full):
            node = self.index.insert(node, request.token_ids[i * bs:(i + 1) * bs], hashes[i],
                                     table[i], request.priority)
            if node.block != table[i]:
                # The index holds this content already (computed twice at once, or a
                # copy-on-write block that ended up equal to its source): switch to the cached
                # block and free the duplicate. A request must hold every node on its path: an
                # idle node above a held one could not be evicted though the pool counts it as
                # available, and the cursor node could be evicted under the request.
                self.pool.share([node.block])
                self.pool.release([table[i]])
                table[i] = node.block
        if self.tier_link is not None:
            self.tier_link.save_computed(table, hashes, cursor.num_blocks, full)
        cursor.node = node
        cursor.num_blocks = full

    def reset_prefix_cache(self) -> None:
        if self.index is not None:
            self.index.reset()

    # -- allocation -------------------------------------------------------------------------
    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks still missing to hold the request's computed tokens plus `num_new_tokens`."""
        held = len(self.block_tables.get(request.request_id, ()))
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        missing = self.num_new_blocks(request, num_new_tokens)
        if missing > self.pool.num_available:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        if missing:
            table.extend(self.pool.allocate(missing))
        return True

    def free(self, request: Request) -> None:
        """Give back every block of a finished, aborted or preempted request; cached blocks stay
        in the index, idle, until evicted."""
        self._cursors.pop(request.request_id, None)
        if self.tier_link is not None:
            self.tier_link.forget(request)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self._drop_pending_copies(table)
            self.pool.release(table)

    def _drop_pending_copies(self, table: list[int]) -> None:
        """Forget the queued copies into blocks being given back, and unlock their sources.
        Copies are applied in the step that queued them, so one is still queued only when a
        step failed before the runner (the engine then aborts its requests); left queued, it
        would be applied in the next step into a block that may belong to someone else by
        then (say, a block just loaded from a tier), and its source would stay locked."""
        if not self._pending_copies:
            return
        freed = set(table)
        dropped = [s for s, d in self._pending_copies if d in freed]
        if dropped:
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in freed]
            self.pool.release(dropped)

    def block_table(self, request: Request) -> list[int]:
        return self.block_tables[request.request_id]

    def check_invariants(self, requests: list[Request]) -> None:
        """Tables belong to live requests, cover their computed tokens, and match the pool."""
        live = {r.request_id: r for r in requests}
        assert set(self.block_tables) <= set(live), "a block table outlived its request"
        for rid, table in self.block_tables.items():
            need = self.blocks_for_tokens(live[rid].num_computed_tokens)
            assert len(table) >= need, f"request {rid} holds {len(table)} blocks, needs {need}"
        holders = list(self.block_tables.values()) + [[s] for s, _ in self._pending_copies]
        self.pool.check_invariants(holders)
        if self.index is not None:
            self.index.check_invariants()
