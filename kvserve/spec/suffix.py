"""Suffix drafting from the prefix index: the longest match of a request's recent tokens
anywhere in the radix tree of cached blocks, continued along its most used child.

Why the tree: it already holds, as token blocks, every prompt and verified output the engine
has cached: the document a question is about, the file being rewritten, earlier turns of the
chat and other requests' answers to the same prompt. A match anywhere in it (not only from a
root, as a prefix hit) names a place that text went on from before; where it branched, the
child hit most often (`Node.hit_count`, then the most recently used) is the likeliest way on.

The drafter keeps its own map from each m-gram (m = prompt_lookup_min) to the places in the
tree where it ends, built from the blocks the index holds: new ones are found each call by
comparing the index's block -> node map with what was indexed (a block reused by another node
counts as new), and only when the index stored a block since the last call; entries of
evicted nodes are dropped when a lookup meets them, and the whole map is built anew once the
nodes it has seen are more than twice those the index holds. Only the
request's own namespace (its cache salt's root) is searched, so one tenant's cached text never
drafts another's: even though verification keeps outputs exact, acceptance rates would time it.
"""

from __future__ import annotations

from typing import Any, Iterator

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.hashing import extra_keys
from kvserve.kv.prefix_index import Node
from kvserve.request import Request
from kvserve.spec.config import SpeculativeConfig

_MAX_CANDIDATES = 32  # places a lookup compares (the latest indexed first)

Place = tuple[Node, int]  # a node and a token offset in it: the gram ends just before it


class SuffixDrafter:
    def __init__(self, kv: Any, config: SpeculativeConfig) -> None:
        """`kv`: the KV cache manager (its first group's prefix index is searched)."""
        self.kv = kv
        self.m = config.prompt_lookup_min
        self.longest = max(config.prompt_lookup_max, self.m)
        self._indexed: dict[int, Node] = {}  # block -> the node its grams were indexed for
        self._grams: dict[tuple[bytes, tuple[int, ...]], list[Place]] = {}
        self._namespace: dict[Node, bytes] = {}
        self._generation = -1
        self._stored = -1  # the index's num_stored_blocks when the map was last brought up

    def __call__(self, request: Request, k: int) -> list[int]:
        tokens = request.token_ids
        if len(tokens) < self.m:
            return []
        self._refresh()
        key = (extra_keys(request.cache_salt), tuple(tokens[-self.m:]))
        places = self._grams.get(key)
        if not places:
            return []
        return self._best(places, tokens, k)

    # -- the map ------------------------------------------------------------------------------
    def _refresh(self) -> None:
        index = self.kv.groups[0].index
        if not getattr(index, "enabled", False):
            return
        if index.generation == self._generation and index.num_stored_blocks == self._stored:
            return  # nothing stored since: no scan of every cached block (every decode step)
        self._stored = index.num_stored_blocks
        current = index.nodes_by_block()
        # After a reset, or once evicted nodes' entries could outnumber the live ones: anew.
        if index.generation != self._generation or \
                len(self._namespace) > 2 * len(current) + 256:
            self._generation = index.generation
            self._indexed.clear()
            self._grams.clear()
            self._namespace.clear()
        indexed = self._indexed
        for block, node in current.items():
            if indexed.get(block) is not node:
                indexed[block] = node
                self._add(node, index)

    def _add(self, node: Node, index: Any) -> None:
        ns = self._namespace_of(node, index)
        for end in range(1, len(node.tokens) + 1):
            gram = self._gram_ending(node, end)
            if gram is not None:
                self._grams.setdefault((ns, gram), []).append((node, end))

    def _namespace_of(self, node: Node, index: Any) -> bytes:
        path = []
        while node.parent is not None and node not in self._namespace:
            path.append(node)
            node = node.parent
        if node.parent is None:
            ns = next((key for key, root in index.roots().items() if root is node), b"")
        else:
            ns = self._namespace[node]
        for n in path:
            self._namespace[n] = ns
        return ns

    def _gram_ending(self, node: Node, end: int) -> tuple[int, ...] | None:
        gram = [t for _, t in zip(range(self.m), _backward(node, end))]
        return tuple(reversed(gram)) if len(gram) == self.m else None

    # -- a lookup -----------------------------------------------------------------------------
    def _best(self, places: list[Place], tokens: list[int], k: int) -> list[int]:
        """The continuation of the place whose match with the request's tail is longest (then
        whose continuation was used most); evicted places are dropped on the way."""
        live = self.kv.groups[0].index.nodes_by_block()
        best: tuple[int, int] | None = None
        draft: list[int] = []
        alive = [p for p in places if live.get(p[0].block) is p[0] and p[0].block != NULL_BLOCK]
        places[:] = alive
        for node, end in reversed(alive[-_MAX_CANDIDATES:]):
            length = self.m + self._extend(node, end, tokens)
            following, uses = _continuation(node, end, k)
            if following and (best is None or (length, uses) > best):
                best, draft = (length, uses), following
        return draft

    def _extend(self, node: Node, end: int, tokens: list[int]) -> int:
        """How many tokens before the gram also agree (up to prompt_lookup_max in all)."""
        back = _backward(node, end)
        for _ in range(self.m):
            next(back, None)
        n = 0
        limit = min(self.longest - self.m, len(tokens) - self.m)
        for token in back:
            if n >= limit or token != tokens[-self.m - n - 1]:
                break
            n += 1
        return n


def _backward(node: Node, end: int) -> Iterator[int]:
    """The tree's tokens before offset `end` of `node`, nearest first, up to the root."""
    while node is not None and node.tokens:
        for i in range(end - 1, -1, -1):
            yield node.tokens[i]
        node = node.parent
        end = len(node.tokens) if node is not None else 0


def _continuation(node: Node, end: int, k: int) -> tuple[list[int], int]:
    """Up to k tokens after offset `end` of `node`, through the most used cached child at each
    branch; and how often the first block of it was used."""
    out = list(node.tokens[end:end + k])
    uses = node.hit_count
    while len(out) < k:
        children = [c for c in node.children.values() if c.block != NULL_BLOCK]
        if not children:
            break
        node = max(children, key=lambda c: (c.hit_count, c.last_access))
        if len(out) == 0:
            uses = node.hit_count
        out.extend(node.tokens[:k - len(out)])
    return out, uses
