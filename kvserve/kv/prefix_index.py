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
eviction policy; entries go stale instead of being removed (a version number per node), so both
pushing and evicting cost O(log n) and nothing is ever rebuilt.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool

POLICIES = ("lru", "lfu", "priority")


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    block_hash: int
    block: int  # -1 for a root
    parent: "Node | None"
    depth: int = 0  # blocks from the root: this node is block depth - 1 of its sequences
    children: dict[int, "Node"] = field(default_factory=dict)  # by block hash
    by_first_token: dict[int, list["Node"]] = field(default_factory=dict)  # for partial matches
    last_access: int = 0
    hit_count: int = 0
    priority: int = 0
    version: int = 0  # bumped on every heap push; older heap entries are stale


@dataclass
class PrefixMatch:
    nodes: list[Node]  # matched full blocks, root first
    partial: Node | None = None  # a child sharing `partial_len` leading tokens of the next block
    partial_len: int = 0
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.block_size + self.partial_len

    @property
    def num_full_blocks(self) -> int:
        """Leading full blocks the request need not compute."""
        return len(self.nodes)

    @property
    def blocks(self) -> list[int]:
        return [n.block for n in self.nodes]

    @property
    def last_node(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None


class PrefixIndex:
    def __init__(self, pool: BlockPool, block_size: int, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self._roots: dict[bytes, Node] = {}
        self._node_of_block: dict[int, Node] = {}
        self._heap: list[tuple[tuple[int, ...], int, Node]] = []
        self._clock = itertools.count(1)
        self.generation = 0  # bumped by reset(): nodes from before are gone
        self.num_evicted_blocks = 0
        # Hears of each block just before eviction frees it, while its KV is still intact (the
        # storage tiers save it then).
        self.on_evict: Callable[[Node], None] | None = None
        pool.evict = self.evict
        pool.on_idle = self._on_idle

    # -- lookup -----------------------------------------------------------------------------
    def root(self, extra: bytes) -> Node:
        node = self._roots.get(extra)
        if node is None:
            node = self._roots[extra] = Node((), 0, -1, None)
        return node

    def match(self, tokens: Sequence[int], hashes: Sequence[int], extra: bytes = b"") -> PrefixMatch:
        """Longest cached prefix of `tokens` (whose full-block hashes are `hashes`)."""
        bs = self.block_size
        node = self._roots.get(extra)
        result = PrefixMatch([], block_size=bs)
        if node is None:
            return result
        for i, h in enumerate(hashes[: len(tokens) // bs]):
            child = node.children.get(h)
            if child is None or child.tokens != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            result.nodes.append(child)
            node = child
        start = len(result.nodes) * bs
        rest = tokens[start:start + bs]
        if rest:
            for child in node.by_first_token.get(rest[0], ()):
                n = common_prefix(child.tokens, rest)
                if n > result.partial_len:
                    result.partial, result.partial_len = child, n
        return result

    def touch(self, nodes: Sequence[Node], priority: int = 0) -> None:
        """Record a use of these nodes (a hit or an insertion) for the eviction policy."""
        now = next(self._clock)
        for node in nodes:
            node.last_access = now
            node.hit_count += 1
            node.priority = max(node.priority, priority)

    # -- insertion --------------------------------------------------------------------------
    def insert(self, parent: Node, tokens: Sequence[int], block_hash: int, block: int,
               priority: int = 0) -> Node:
        """Add one full block under `parent`; if the same content is cached already, the
        existing node is returned (and its block is the one to use from now on)."""
        existing = parent.children.get(block_hash)
        if existing is not None:
            self.touch([existing], priority)
            return existing
        node = Node(tuple(tokens), block_hash, block, parent, parent.depth + 1)
        parent.children[block_hash] = node
        parent.by_first_token.setdefault(node.tokens[0], []).append(node)
        self._node_of_block[block] = node
        self.pool.mark_cached(block)
        self.touch([node], priority)
        return node

    # -- eviction ---------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of_block)

    def _key(self, node: Node) -> tuple[int, ...]:
        if self.policy == "lfu":
            return (node.hit_count, node.last_access)
        if self.policy == "priority":
            return (node.priority, node.last_access)
        return (node.last_access,)

    def _push(self, node: Node) -> None:
        node.version += 1
        heapq.heappush(self._heap, (self._key(node), node.version, node))
        if len(self._heap) > 2 * len(self._node_of_block) + 1024:
            # Stale entries pile up when blocks go idle and busy again without evictions; drop
            # them now and then (O(n) every ~n pushes: O(1) amortised).
            self._heap = [e for e in self._heap if self._evictable(e[2], e[1])]
            heapq.heapify(self._heap)

    def _on_idle(self, block: int) -> None:
        node = self._node_of_block[block]
        if not node.children:
            self._push(node)

    def _evictable(self, node: Node, version: int) -> bool:
        return (version == node.version and not node.children
                and self._node_of_block.get(node.block) is node
                and self.pool.ref_counts[node.block] == 0)

    def evict(self, n: int) -> int:
        """Free up to `n` idle blocks, leaves first, in policy order; returns how many."""
        done = 0
        while done < n and self._heap:
            _, version, node = heapq.heappop(self._heap)
            if not self._evictable(node, version):
                continue
            if self.on_evict is not None:
                self.on_evict(node)
            self._remove(node)
            done += 1
            parent = node.parent
            if (parent is not None and parent.block >= 0 and not parent.children
                    and self.pool.ref_counts[parent.block] == 0):
                self._push(parent)
        self.num_evicted_blocks += done
        return done

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.block_hash]
        siblings = parent.by_first_token[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first_token[node.tokens[0]]
        del self._node_of_block[node.block]
        self.pool.uncache(node.block)

    def reset(self) -> None:
        """Forget every cached block: idle ones return to the free list at once, held ones when
        their requests let go."""
        for block in list(self._node_of_block):
            self.pool.uncache(block)
        self._node_of_block.clear()
        self._roots.clear()
        self._heap.clear()
        self.generation += 1

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Tree and pool agree: every node's block is cached and reachable, parents link back."""
        seen = 0
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                seen += 1
                assert self._node_of_block.get(node.block) is node, "node/block map is off"
                assert self.pool.cached[node.block], "a tree block is not marked cached"
                assert node.parent is not None and node.parent.children[node.block_hash] is node
                assert len(node.tokens) == self.block_size
                stack.extend(node.children.values())
        assert seen == len(self._node_of_block), "unreachable nodes in the block map"
        assert sum(self.pool.cached) == seen, "cached flags disagree with the tree"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
