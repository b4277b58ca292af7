"""What the KV cache reads of a sequence (`CachedSeq`), and the two lengths derived from it.

Apart from kv/manager.py so that whatever holds sequences (the engine's `Request`, the
simulator's `SimSeq`, the bounded-cache hooks) can name the protocol without the manager.
"""

from __future__ import annotations

from typing import Protocol


class CachedSeq(Protocol):
    """What the cache reads of a request (the engine's `Request`, the simulator's `SimSeq`)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # written only by the sequence's owner
    cache_salt: str | None
    priority: int
    block_hashes: list[int]  # chained hashes of full blocks, extended on demand by the manager
    # True for a sequence that needs every prompt position's logits (vLLM's name): it reads
    # nothing from the cache, though its computed blocks are still published for others.
    skip_reading_prefix_cache: bool
    # Tokens whose KV a bounded cache (kvserve.kv.bounded) dropped: the sequence holds
    # num_computed_tokens - this many (0 for every other sequence).
    num_dropped_tokens: int


def tenant_of(seq: CachedSeq) -> str:
    """Whose cached blocks a sequence's are, for tenant quotas: its `tenant` (the server sets
    it from the API key under `--kv-tenant-by api_key`), else its cache salt."""
    return getattr(seq, "tenant", None) or seq.cache_salt or ""


def matchable_tokens(seq: CachedSeq) -> int:
    """How much of a sequence the cache may serve: all but its last token, whose logits are
    needed, so at least one token is always computed; nothing for a sequence that needs the
    logits of every position (a cached block holds KV, not the hidden states logits come
    from)."""
    if seq.skip_reading_prefix_cache:
        return 0
    return max(len(seq.token_ids) - 1, 0)


def kv_length(seq: CachedSeq) -> int:
    """Tokens of KV a sequence holds: its computed tokens, less those a bounded cache dropped
    (kvserve.kv.bounded)."""
    return seq.num_computed_tokens - seq.num_dropped_tokens
