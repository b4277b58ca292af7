"""Allocation modes: contiguous preallocation to the maximum length vs paged blocks.

Both run on kvserve's `KVCacheManager` (prefix caching off): contiguous preallocation is a paged
pool whose one block per request is `max_model_len` tokens long, which is exactly what reserving
a max-length slab per request means. Requests of the trace's lengths (prompt + output, capped at
`max_model_len`) are admitted in trace order, cycling, until the pool refuses one; that count is
the maximum concurrency, and the unused part of the blocks they hold is the wasted memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv.manager import KVCacheManager
from kvserve.planner.memory import fragmentation
from kvserve.sim.replay import SimSeq


def fill(lengths: Sequence[int], capacity_tokens: int, block_size: int) -> dict:
    """Admit requests of `lengths` (cycling) into a pool of `capacity_tokens` until one is
    refused."""
    kv = KVCacheManager(capacity_tokens // block_size, block_size, enable_prefix_caching=False)
    if kv.num_blocks < 1:
        raise ValueError(f"{capacity_tokens} tokens hold no block of {block_size}")
    used = 0
    admitted = 0
    i = 0
    limit = kv.num_blocks + 1  # every admitted request holds at least one block
    while admitted < limit:
        n = lengths[i % len(lengths)]
        i += 1
        req = SimSeq(str(i), [0] * n)
        if kv.admit(req, kv.match(req), n) is None:
            break
        req.num_computed_tokens = n
        used += n
        admitted += 1
    held = (kv.num_blocks - kv.pool.num_available) * block_size
    return dict(max_concurrency=admitted, used_tokens=used, held_tokens=held,
                wasted_frac=(held - used) / held if held else 0.0)


def allocation_modes(lengths: Sequence[int], capacity_tokens: int, max_model_len: int,
                     block_sizes: Sequence[int] = (16, 32, 64)) -> list[dict]:
    if not lengths:
        raise ValueError("no request lengths")
    capped = [min(max(1, n), max_model_len) for n in lengths]
    rows = []
    contiguous = fill(capped, capacity_tokens, max_model_len)
    expected = fragmentation(max_model_len, capped)
    rows.append(dict(mode="contiguous", block_size=max_model_len,
                     expected_wasted_frac=expected.waste_frac_of_allocated, **contiguous))
    for bs in block_sizes:
        got = fill(capped, capacity_tokens, bs)
        expected = fragmentation(bs, capped)
        rows.append(dict(mode=f"paged-{bs}", block_size=bs,
                         expected_wasted_frac=expected.waste_frac_of_allocated, **got))
    return rows
