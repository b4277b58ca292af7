"""Chained content hashes of full KV blocks: the name a block goes by everywhere.

hash(block i) = xxh3-128(hash(block i-1) || token ids of block i || extra keys), so equal hashes
mean equal token prefixes (up to 2^-128), in any process, on any machine: the prefix index, the
storage tiers, the router and the simulator all name blocks by it. Python's `hash()` is salted per
process and never used.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0  # the "parent" of a sequence's first block


def extra_keys(cache_salt: str | None) -> bytes:
    """Bytes mixed into every block hash of a request: requests whose extra keys differ never
    share a block (vLLM's cache_salt)."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")


def block_hash(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    h = xxhash.xxh3_128()
    h.update(parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.intdigest()


def chain_hashes(tokens: Sequence[int], block_size: int, extra: bytes = b"",
                 parent: int = ROOT_HASH, start_block: int = 0) -> list[int]:
    """Hashes of the full blocks of `tokens` from block `start_block` on, chained from `parent`
    (the hash of block start_block - 1)."""
    out = []
    for i in range(start_block, len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out
