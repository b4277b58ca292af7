"""The prefix index: a radix tree over cached KV blocks, with O(log n) eviction.

Each node is one full block: its tokens, its chained hash (kv/hashing.py) and the physical block
that holds its KV. A path from a root spells a token prefix, so `match` walks a request's block
hashes down the tree and returns the longest cached prefix. Edges are whole blocks, so the tree is
page-aligned by construction and no node ever needs splitting; a match that ends inside a block is
reported as a partial hit (the child sharing the most leading tokens), which the manager serves by
copying that block (copy-on-write). Each extra-key namespace (cache_salt) has a root of its own,
so partial matching never looks across tenants either.

Who may evict what: a block held by a request (ref count > 0) is locked, and so is every ancestor
of it, because a request holds its whole prefix. Idle leaves are kept in a heap keyed by the
eviction policy (kv/eviction.py); entries go stale instead of being removed (a version number per
node), so both pushing and evicting cost O(log n) and nothing is ever rebuilt. The index is asked
top-down: the manager calls `evict` when it needs blocks and `mark_idle` with the blocks a release
turned idle; nothing calls back up.

Windowed caches (every layer has a sliding window W; the manager releases blocks wholly before
a sequence's window): an idle node with children may then be evicted too. It stays in the tree
*hollow* (its block is NULL_BLOCK), so the path to its descendants survives, and a later request
computing the same block fills it again. A hit at depth d needs only the blocks a query at
position d * block_size can see, those from `first_visible(d * block_size) // block_size` on
(vLLM's rule for sliding-window groups), so long shared prefixes stay reusable without keeping
the windowed layers' whole history. A hollow node that loses its last child is removed.

Retention and quotas (kv/retention.py, issue 33): idle blocks are ordered by retention priority
before the policy's key (every block has the default unless a request asked otherwise), and TTLs
are re-keyed when the index next evicts. With tenant quotas on, each tenant's idle leaves are also
kept in a heap of their own, and a tenant whose idle cached blocks exceed the quota gives its own
blocks first. An audit that finds a block's KV wrong `drop`s it with everything below it.

`NoPrefixCache` is the same interface with nothing behind it (prefix caching off).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.events import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, KVEventLog
from kvserve.kv.eviction import EvictionPolicy, make_eviction_policy
from kvserve.kv.evicted import EvictionRecord
from kvserve.kv.retention import DEFAULT_PRIORITY
from kvserve.kv.spec import first_needed_block


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    block_hash: int
    block: int  # -1 for a root; NULL_BLOCK (-1) for a hollow node too (windowed caches)
    parent: "Node | None"
    depth: int = 0  # blocks from the root: this node is block depth - 1 of its sequences
    children: dict[int, "Node"] = field(default_factory=dict)  # by block hash
    by_first_token: dict[int, list["Node"]] = field(default_factory=dict)  # for partial matches
    last_access: int = 0
    last_used: float = 0.0  # the index clock's time of that use (the tree view's age)
    hit_count: int = 0
    priority: int = 0
    version: int = 0  # bumped on every heap push; older heap entries are stale
    retention: int = DEFAULT_PRIORITY  # kv/retention.py: lower goes first, before the policy
    retain_until: float = 0.0  # the index clock's time `retention` lasts until (0: no TTL)
    after: int = DEFAULT_PRIORITY  # the retention once `retain_until` has passed
    tenant: str = ""  # whose block it is, for tenant quotas (the inserting request's)
    dropped: bool = False  # taken out of the tree by `drop`: nothing may publish under it


@dataclass
class PrefixMatch:
    """What the device holds of a request: full blocks, then perhaps a partially matching block
    (served by copy-on-write). The storage tiers continue a match in a type of their own
    (kv/tiers/link.py's `TieredMatch`), so the index knows nothing of them."""

    nodes: list[Node]  # matched full blocks, root first
    partial: Node | None = None  # a child sharing `partial_len` leading tokens of the next block
    partial_len: int = 0
    block_size: int = 0
    # Hybrid layouts (several KV groups, kv/manager.py): each group's matched nodes, as deep as
    # `nodes` (which are group 0's); None with one group.
    group_nodes: list[list[Node]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_full_blocks * self.block_size + self.partial_len

    @property
    def num_full_blocks(self) -> int:
        """Leading full blocks the request need not compute."""
        return len(self.nodes)

    def without_partial(self) -> "PrefixMatch":
        """The same match less its partially matched block (which is then computed)."""
        return dataclasses.replace(self, partial=None, partial_len=0)


class PrefixIndex:
    enabled = True

    def __init__(self, pool: BlockPool, block_size: int,
                 policy: str | EvictionPolicy = "lru", events: KVEventLog | None = None,
                 window: int | None = None) -> None:
        self.pool = pool
        self.window = window  # every layer's window (None: some layer attends to everything)
        self.events = events if events is not None else KVEventLog(0)  # off unless given
        self.block_size = block_size
        self.policy = make_eviction_policy(policy) if isinstance(policy, str) else policy
        self._roots: dict[bytes, Node] = {}
        self._node_of_block: dict[int, Node] = {}
        # (retention, policy key, depth, push order, version, node): ties go to the shallower
        # node (in a windowed cache, the one furthest before the windows), then the older push.
        self._heap: list[tuple[int, tuple[int, ...], int, int, int, Node]] = []
        self.clock = time.monotonic  # retention TTLs' clock (the simulator sets its own)
        self._ttl_heap: list[tuple[float, int, Node]] = []
        # Tenant quotas (`set_tenant_quota`): idle leaves per tenant too; None: off.
        self.quota_blocks: int | None = None
        self._tenant_heaps: dict[str, list] | None = None
        self._pushes = itertools.count()
        self._clock = itertools.count(1)
        self.generation = 0  # bumped by reset(): nodes from before are gone
        # block -> node entries ever set (insert): a reader that mirrors nodes_by_block (the
        # suffix drafter) scans the map only when this moved
        self.num_stored_blocks = 0
        self.num_evicted_blocks = 0
        # Recently evicted hashes, for the cache report's `evicted` (kv/report.py); None: off.
        self.evictions: EvictionRecord | None = EvictionRecord()

    # -- lookup -----------------------------------------------------------------------------
    def roots(self) -> dict[bytes, Node]:
        """Each namespace's root (the tree view, kv/tree_view.py: read-only)."""
        return dict(self._roots)

    def root_keys(self) -> list[bytes]:
        """The extra-key namespaces (cache salts) that have a root (the cache report's)."""
        return list(self._roots)

    def nodes_by_block(self) -> dict[int, Node]:
        """Every cached node by its block (read-only: speculative decoding's suffix drafter
        indexes their tokens)."""
        return self._node_of_block

    def root(self, extra: bytes) -> Node:
        node = self._roots.get(extra)
        if node is None:
            node = self._roots[extra] = Node((), 0, -1, None)
        return node

    def match(self, tokens: Sequence[int], hashes: Sequence[int], extra: bytes = b"") -> PrefixMatch:
        """Longest cached prefix of `tokens` (whose full-block hashes are `hashes`)."""
        bs = self.block_size
        result = PrefixMatch([], block_size=bs)
        if self._roots.get(extra) is None:
            return result
        path = self.walk(tokens, hashes, extra)
        depth = self._valid_depth(path)
        result.nodes = path[:depth]
        if depth < len(path):
            return result  # the block after the hit is hollow or unreachable: no partial hit
        node = path[-1] if path else self._roots[extra]
        start = len(result.nodes) * bs
        rest = tuple(tokens[start:start + bs])  # common_prefix compares it with a tuple
        if rest:
            for child in node.by_first_token.get(rest[0], ()):
                if child.block == NULL_BLOCK:
                    continue
                n = common_prefix(child.tokens, rest)
                if n > result.partial_len:
                    result.partial, result.partial_len = child, n
        return result

    def walk(self, tokens: Sequence[int], hashes: Sequence[int], extra: bytes = b""
             ) -> list[Node]:
        """The nodes (hollow ones included) along `tokens`' full blocks, root first."""
        bs = self.block_size
        node = self._roots.get(extra)
        path: list[Node] = []
        if node is None:
            return path
        for i, h in enumerate(hashes[: len(tokens) // bs]):
            child = node.children.get(h)
            if child is None or child.tokens != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            path.append(child)
            node = child
        return path

    def first_needed(self, depth: int) -> int:
        """The first block a sequence resuming after `depth` full blocks reads (0 without a
        window)."""
        return first_needed_block(depth * self.block_size, self.window, self.block_size)

    def valid_depths(self, path: Sequence[Node]) -> list[bool]:
        """For each depth 0..len(path): whether a hit there has all its needed blocks present
        (depth 0, no hit, always has)."""
        if self.window is None:  # a full-attention index has no hollow nodes
            return [True] * (len(path) + 1)
        valid, last_hollow = [True], -1
        for d, node in enumerate(path, start=1):
            if node.block == NULL_BLOCK:
                last_hollow = d - 1
            valid.append(node.block != NULL_BLOCK and last_hollow < self.first_needed(d))
        return valid

    def _valid_depth(self, path: Sequence[Node]) -> int:
        """The deepest hit point along a matched path whose needed blocks are all present."""
        if self.window is None:  # a full-attention index has no hollow nodes
            return len(path)
        valid = self.valid_depths(path)
        return max(d for d, ok in enumerate(valid) if ok)

    def touch(self, nodes: Sequence[Node], priority: int = 0) -> None:
        """Record a use of these nodes (a hit or an insertion) for the eviction policy."""
        now, when = next(self._clock), self.clock()
        for node in nodes:
            node.last_access, node.last_used = now, when
            node.hit_count += 1
            node.priority = max(node.priority, priority)

    def retain(self, node: Node, priority: int, until: float | None, after: int) -> None:
        """Give a node a retention priority until `until` (None: while cached), then `after`;
        a weaker one than the node has (lower, or as high but shorter) changes nothing."""
        cur_until = node.retain_until or float("inf")
        new_until = until if until is not None else float("inf")
        unset = node.retention == DEFAULT_PRIORITY and not node.retain_until
        if not unset and (priority, new_until) <= (node.retention, cur_until):
            return
        node.retention, node.after = priority, after
        node.retain_until = until if until is not None else 0.0
        if until is not None:
            heapq.heappush(self._ttl_heap, (until, next(self._pushes), node))
        if node.block != NULL_BLOCK and self._evictable(node, node.version):
            self._push(node)  # idle in the heap under its old key

    def _expire(self) -> None:
        """Retentions whose TTL has passed fall back to their `after` priority."""
        heap = self._ttl_heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            until, _, node = heapq.heappop(heap)
            if node.retain_until != until or node.dropped:
                continue  # refreshed or strengthened since, or gone
            node.retention, node.retain_until = node.after, 0.0
            if node.block != NULL_BLOCK and self._evictable(node, node.version):
                self._push(node)

    def set_tenant_quota(self, blocks: int) -> None:
        """Bound each tenant's idle cached blocks: past `blocks`, its own go first."""
        self.quota_blocks = blocks
        self._tenant_heaps = {}
        self.pool.track_tenants()

    # -- insertion --------------------------------------------------------------------------
    def insert(self, parent: Node, tokens: Sequence[int], block_hash: int, block: int,
               priority: int = 0, tenant: str = "") -> Node:
        """Add one full block under `parent`; if the same content is cached already, the
        existing node is returned (and its block is the one to use from now on)."""
        existing = parent.children.get(block_hash)
        if existing is not None:
            if existing.block == NULL_BLOCK:  # hollow: this block fills it again
                existing.block = block
                self._node_of_block[block] = existing
                self.num_stored_blocks += 1
                self.pool.mark_cached(block, existing.tenant)
                self.events.record(BLOCK_STORED, block_hash, parent.block_hash)
            self.touch([existing], priority)
            return existing
        node = Node(tuple(tokens), block_hash, block, parent, parent.depth + 1, tenant=tenant)
        parent.children[block_hash] = node
        parent.by_first_token.setdefault(node.tokens[0], []).append(node)
        self._node_of_block[block] = node
        self.num_stored_blocks += 1
        self.pool.mark_cached(block, tenant)
        self.touch([node], priority)
        self.events.record(BLOCK_STORED, block_hash, parent.block_hash)
        return node

    # -- eviction ---------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of_block)

    def _push(self, node: Node) -> None:
        node.version += 1
        entry = (node.retention, self.policy.key(node), node.depth, next(self._pushes),
                 node.version, node)
        heapq.heappush(self._heap, entry)
        if self._tenant_heaps is not None:
            heapq.heappush(self._tenant_heaps.setdefault(node.tenant, []), entry)
        if len(self._heap) > 2 * len(self._node_of_block) + 1024:
            # Stale entries pile up when blocks go idle and busy again without evictions; drop
            # them now and then (O(n) every ~n pushes: O(1) amortised).
            self._heap = self._live(self._heap)
            if self._tenant_heaps is not None:
                self._tenant_heaps = {t: self._live(h) for t, h in self._tenant_heaps.items()}

    def _live(self, heap: list) -> list:
        live = [e for e in heap if self._evictable(e[5], e[4])]
        heapq.heapify(live)
        return live

    def _next_heap(self) -> list:
        """The heap to evict from: the most-over-quota tenant's, or the common one."""
        tenants = self._tenant_heaps
        if tenants is not None:
            idle, quota = self.pool.idle_by_tenant, self.quota_blocks
            over = [(idle[t] - quota, t) for t, h in tenants.items() if h and idle[t] > quota]
            if over:
                return tenants[max(over)[1]]
        return self._heap

    def mark_idle(self, blocks: Sequence[int]) -> None:
        """These cached blocks lost their last holder: the leaves among them (any of them, in a
        windowed cache) become evictable."""
        for block in blocks:
            node = self._node_of_block[block]
            if not node.children or self.window is not None:
                self._push(node)

    def _evictable(self, node: Node, version: int) -> bool:
        return (version == node.version
                and (not node.children or self.window is not None)
                and node.block != NULL_BLOCK
                and self._node_of_block.get(node.block) is node
                and self.pool.ref_counts[node.block] == 0)

    def evict(self, n: int) -> list[Node]:
        """Free up to `n` idle blocks, leaves first, in policy order; returns the evicted nodes
        (their parent links still name the rest of their chunk, for the storage tiers)."""
        evicted: list[Node] = []
        record = self.evictions
        # one stamp per call (time, policy, pool usage before it): the record costs a dict set
        # per evicted block
        stamp = (time.time(), self.policy.name, self.pool.usage) if record is not None else None
        self._expire()
        while len(evicted) < n:
            heap = self._next_heap()
            if not heap:
                break
            *_, version, node = heapq.heappop(heap)
            if not self._evictable(node, version):
                continue
            evicted.append(node)
            if record is not None:
                record.record(node.block_hash, stamp)
            if node.children:  # windowed: keep the path to the children, drop the block
                self._hollow(node)
                continue
            self._remove(node)
            self._prune_above(node)
        self.num_evicted_blocks += len(evicted)
        return evicted

    def drop(self, node: Node) -> list[Node]:
        """Take a node and everything below it out of the index, held or not (an audit found
        its KV wrong; what follows it was computed on top of it). Holders keep their blocks,
        which go to the free list, not the cache, when let go; returns the dropped nodes."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children first: `_remove` takes leaves
            n.dropped = True
            self._remove(n)
        self._prune_above(node)
        return order

    def _prune_above(self, node: Node) -> None:
        """After `node` left the tree: hollow ancestors that lead nowhere now go too, and the
        first cached one, if it became an idle leaf, becomes evictable."""
        parent = node.parent
        while parent is not None and parent.parent is not None \
                and parent.block == NULL_BLOCK and not parent.children:
            self._remove(parent)  # a hollow node leads nowhere any more
            parent = parent.parent
        if (parent is not None and parent.block >= 0 and not parent.children
                and self.pool.ref_counts[parent.block] == 0):
            self._push(parent)

    def _hollow(self, node: Node) -> None:
        """Evict an interior node's block but keep the node (windowed caches). No event: a
        gateway counts a request's leading block hashes until the first one it misses (hashes
        are chained), and hits past a hollow node stay valid (they need only the window's
        blocks), so the hash stays in its picture until the node leaves the tree (`_remove`
        records its BlockRemoved then). Filling it again records a BlockStored, which a
        picture that has the hash already takes as a touch."""
        del self._node_of_block[node.block]
        self.pool.uncache(node.block)
        node.block = NULL_BLOCK
        assert node.parent is not None

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.block_hash]
        siblings = parent.by_first_token[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first_token[node.tokens[0]]
        if node.block != NULL_BLOCK:  # a hollow node's block was uncached when hollowed
            del self._node_of_block[node.block]
            self.pool.uncache(node.block)
        self.events.record(BLOCK_REMOVED, node.block_hash, parent.block_hash)

    def reset(self) -> None:
        """Forget every cached block: idle ones return to the free list at once, held ones when
        their requests let go."""
        for block in list(self._node_of_block):
            self.pool.uncache(block)
        self._node_of_block.clear()
        self._roots.clear()
        self._heap.clear()
        self._ttl_heap.clear()
        if self._tenant_heaps is not None:
            self._tenant_heaps.clear()
        self.generation += 1
        self.events.record(ALL_BLOCKS_CLEARED, 0, 0)

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Tree and pool agree: every node's block is cached and reachable, parents link back;
        hollow nodes exist only in windowed caches, and only above another node."""
        seen = 0
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.block == NULL_BLOCK:
                    assert self.window is not None and node.children, "a stray hollow node"
                    assert node.parent is not None and node.parent.children[node.block_hash] is node
                    stack.extend(node.children.values())
                    continue
                seen += 1
                assert self._node_of_block.get(node.block) is node, "node/block map is off"
                assert self.pool.cached[node.block], "a tree block is not marked cached"
                assert node.parent is not None and node.parent.children[node.block_hash] is node
                assert len(node.tokens) == self.block_size
                stack.extend(node.children.values())
        assert seen == len(self._node_of_block), "unreachable nodes in the block map"
        # Several indexes (one per KV group) may share the pool: the manager checks the total.
        assert sum(self.pool.cached) >= seen, "cached flags disagree with the tree"


class NoPrefixCache:
    """Prefix caching off: the index's interface, matching nothing and keeping nothing."""

    enabled = False
    events = KVEventLog(0)  # nothing is ever stored
    generation = 0
    num_cached_blocks = 0
    num_evicted_blocks = 0
    evictions = None

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._root = Node((), 0, -1, None)

    def root(self, extra: bytes) -> Node:
        return self._root

    def roots(self) -> dict[bytes, Node]:
        return {}

    def match(self, tokens: Sequence[int], hashes: Sequence[int], extra: bytes = b"") -> PrefixMatch:
        return PrefixMatch([], block_size=self.block_size)

    def touch(self, nodes: Sequence[Node], priority: int = 0) -> None:
        pass

    def insert(self, parent: Node, tokens: Sequence[int], block_hash: int, block: int,
               priority: int = 0, tenant: str = "") -> Node:
        return Node((), block_hash, block, parent)  # not kept: the block stays the request's

    def mark_idle(self, blocks: Sequence[int]) -> None:
        assert not blocks, "nothing is cached without prefix caching"

    def evict(self, n: int) -> list[Node]:
        return []

    def reset(self) -> None:
        pass

    def check_invariants(self) -> None:
        pass


PrefixCache = PrefixIndex | NoPrefixCache


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix, by bisection on slice equality: C-speed compares,
    not a Python loop (kvserve diagnose compares whole rendered prompts with it). Sequences
    of two types (a node's token tuple, a prompt's list) are compared as tuples."""
    if type(a) is not type(b):
        a, b = tuple(a), tuple(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
