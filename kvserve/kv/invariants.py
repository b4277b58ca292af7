"""The KV cache manager's invariants, checked by the tests and the engine's debug mode: apart
from kv/manager.py because they read every part of it at once and change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.seq import CachedSeq, kv_length


def check_manager(m: Any, seqs: Sequence[CachedSeq]) -> None:
    """Tables belong to live sequences, cover their computed tokens (every block a query can
    still read is held: a released one is never read), and, with the copy sources and the pins,
    account for every reference in the pool."""
    live = {s.request_id: s for s in seqs}
    holders: list[list[int]] = [[s] for s in m._copy_sources] + list(m.pins.holders())
    for i, g in enumerate(m.groups):
        assert set(g.tables) <= set(live), "a block table outlived its request"
        assert set(g.tables) == set(m.block_tables), "groups disagree on who holds blocks"
        for rid, table in g.tables.items():
            computed = kv_length(live[rid])
            need = m.blocks_for_tokens(computed)
            assert len(table) >= need, f"request {rid} holds {len(table)} blocks, needs {need}"
            first = m.first_held_block(computed, group=i)
            assert NULL_BLOCK not in table[first:], \
                f"request {rid} released a block inside its window (from block {first})"
            assert g.window is not None or NULL_BLOCK not in table, "released without a window"
        holders += [[b for b in t if b != NULL_BLOCK] for t in g.tables.values()]
    m.pool.check_invariants(holders)
    for g in m.groups:
        g.index.check_invariants()
    assert sum(m.pool.cached) == sum(g.index.num_cached_blocks for g in m.groups), \
        "cached flags disagree with the indexes"
