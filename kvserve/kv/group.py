"""A KV group's state inside the manager: its block tables, its prefix index and, per sequence,
how far the sequence's blocks are published there. Apart from the manager so that its parts
(kv/lookup.py, kv/allocation.py, kv/manager.py) name the same types without importing each
other."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.prefix_index import Node, PrefixCache



@dataclass
class Cursor:
    """How far a sequence's blocks are in the prefix index: its deepest node, and how many of
    its leading blocks that node's path accounts for."""

    node: Node
    num_blocks: int
    generation: int


@dataclass
class Group:
    """One KV group's block tables, prefix index and cursors (one group unless hybrid)."""

    window: int | None  # release blocks wholly before it (None: keep every block)
    index: PrefixCache
    tables: dict[str, list[int]]
    cursors: dict[str, Cursor]
