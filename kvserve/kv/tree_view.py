"""The prefix tree as a person reads it: the largest shared prefixes, their size, hits and age
(what the web page's tree draws; the admin's view, since it shows what the cache holds).

The index holds one node per block; a person wants the branches. So each maximal chain of
nodes with one child each is one segment: where it starts (tokens from the root), how many
tokens it spans, how many cached blocks hang below its start (what evicting it would cost the
cache), the hits of its first block and how long ago it was last used, its retention (a
priority above the default, and the seconds its TTL has left) and whose it is (the tenant, as
a digest: a salt is meant to be secret), a few tokens of its text, and its children segments.
The widest branches come first and the answer is cut to `limit` segments; the sizes take one
walk of the whole tree per call (bottom up, no recursion), on the engine's thread between
steps, which is why the page asks for it less often than for the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvserve.kv.prefix_index import Node
from kvserve.kv.retention import DEFAULT_PRIORITY
from kvserve.kv.tenant_name import tenant_digest

PREVIEW_TOKENS = 16


def _subtree_blocks(roots: Sequence[Node]) -> dict[int, int]:
    """Blocks at and below each node (by id), counted bottom up without recursion."""
    order: list[Node] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    size: dict[int, int] = {}
    for node in reversed(order):
        size[id(node)] = (node.block >= 0) + sum(size[id(c)] for c in node.children.values())
    return size


def prefix_tree(roots: dict[bytes, Node], block_size: int, now: float,
                decode: Callable[[list[int]], str], limit: int = 64) -> dict[str, Any]:
    """The tree under every namespace's root (a namespace is named only as shared or salted:
    a salt is meant to be secret), widest branches first, at most `limit` segments."""
    size = _subtree_blocks(list(roots.values()))
    shown = 0

    def segment(start: Node) -> dict[str, Any]:
        nonlocal shown
        shown += 1
        node, tokens = start, list(start.tokens)
        while len(node.children) == 1:
            node = next(iter(node.children.values()))
            tokens.extend(node.tokens)
        children = sorted(node.children.values(), key=lambda c: -size[id(c)])
        out = {"start_tokens": (start.depth - 1) * block_size, "tokens": len(tokens),
               "cached_blocks": size[id(start)], "hits": start.hit_count,
               "idle_seconds": round(max(0.0, now - start.last_used), 1),
               "text": decode(tokens[:PREVIEW_TOKENS]), "children": [],
               "tenant": tenant_digest(start.tenant)}
        if start.retention != DEFAULT_PRIORITY:
            out["retention"] = {"priority": start.retention, "seconds_left": None
                                if not start.retain_until
                                else round(max(0.0, start.retain_until - now), 1)}
        for child in children:
            if shown >= limit:
                out["more_children"] = len(children) - len(out["children"])
                break
            out["children"].append(segment(child))
        return out

    namespaces = []
    for extra, root in sorted(roots.items(), key=lambda kv: -size[id(kv[1])]):
        if shown >= limit:
            break
        tops = sorted(root.children.values(), key=lambda c: -size[id(c)])
        branches = []
        for top in tops:
            if shown >= limit:
                break
            branches.append(segment(top))
        namespaces.append({"namespace": "salted" if extra else "shared",
                           "cached_blocks": size[id(root)], "branches": branches})
    return {"block_size": block_size, "namespaces": namespaces,
            "cached_blocks": sum(size[id(r)] for r in roots.values())}
