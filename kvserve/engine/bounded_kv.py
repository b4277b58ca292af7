"""Compaction of bounded KV caches after a step (the policies are in kvserve.kv.bounded).

After the scheduler has advanced a step's requests, each bounded request whose KV reached its
budget plus a block is cut back to its budget: the policy picks the kept tokens, the manager
moves the request onto fresh blocks (`KVCacheManager.reseat`), and the engine copies the kept
tokens' KV there (`KVTensorPool.compact_tokens`) once the step plan has run. A pool too full for
the fresh blocks skips the compaction this step (the request simply holds a little more KV and
tries again next step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.bounded import needs_compaction, streaming_keep
from kvserve.kv.manager import KVCacheManager, kv_length
from kvserve.request import Request


@dataclass(frozen=True)
class KVMove:
    """Copy tokens `keep` of a sequence's old blocks into the first slots of its new ones."""

    src_table: list[int]
    keep: torch.Tensor  # [n] or [kv_heads, n] token indices into the old blocks
    dst_table: list[int]


def select_kept(request: Request, kv_len: int) -> torch.Tensor:
    """The KV indices the request's policy keeps out of its `kv_len`."""
    bound = request.bounded_kv
    assert bound is not None
    if bound.policy == "streaming_llm":
        return streaming_keep(kv_len, bound)
    raise AssertionError(f"unknown bounded KV policy {bound.policy!r}")  # resolve checked it


def compact_bounded(requests: list[Request], kv: KVCacheManager) -> list[KVMove]:
    """Compact every bounded request of the step that is due; returns the KV copies to make."""
    moves = []
    for request in requests:
        bound = request.bounded_kv
        if bound is None or request.finished:
            continue
        kv_len = kv_length(request)
        prompt_done = request.num_computed_tokens >= len(request.prompt_token_ids)
        if not needs_compaction(kv_len, prompt_done, bound, kv.block_size):
            continue
        keep = select_kept(request, kv_len)
        tables = kv.reseat(request, kv.blocks_for_tokens(bound.budget))
        if tables is None:
            continue
        request.num_dropped_tokens += kv_len - bound.budget
        moves.append(KVMove(tables[0], keep, tables[1]))
    return moves
