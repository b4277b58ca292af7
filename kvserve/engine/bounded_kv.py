"""Compaction of bounded KV caches after a step (the policies are in kvserve.kv.bounded).

After the scheduler has advanced a step's requests, each bounded request whose KV reached its
budget plus a block is cut back to its budget: the policy picks the kept tokens, the manager
moves the request onto fresh blocks (`KVCacheManager.reseat`), and the kept tokens' KV is copied
there (`KVTensorPool.compact_tokens`) by the plan handed out right after (kv/plan.py). A pool too full for
the fresh blocks skips the compaction this step (the request simply holds a little more KV and
tries again next step; SnapKV's one selection is then lost, and the request is bounded like
StreamingLLM from there).
"""

from __future__ import annotations

import torch

from kvserve.kv.bounded import (add_votes, h2o_keep, needs_compaction, snapkv_keep,
                                streaming_keep)
from kvserve.kv.manager import KVCacheManager, kv_length
from kvserve.kv.plan import KVMove
from kvserve.request import Request


def compact_bounded(requests: list[Request], kv: KVCacheManager,
                    observed: dict[str, list[torch.Tensor]]) -> list[KVMove]:
    """Compact every bounded request of the step that is due; returns the KV copies to make.
    `observed`: attention votes (SnapKV, H2O) the backend computed this step, by request id, one
    [kv_heads, keys] tensor per layer (taken here, stacked once and added in place to the
    request's `kv_votes`, one [layers, kv_heads, keys] tensor)."""
    moves = []
    for request in requests:
        bound = request.bounded_kv
        votes = observed.pop(request.request_id, None)
        if bound is None or request.finished:
            continue
        if votes is not None:
            request.kv_votes = add_votes(request.kv_votes, votes)
        kv_len = kv_length(request)
        prompt_done = request.num_computed_tokens >= len(request.prompt_token_ids)
        due = needs_compaction(kv_len, prompt_done, bound, kv.block_size)
        snap = bound.policy == "snapkv" and request.kv_votes is not None and prompt_done
        if snap:
            votes_now, request.kv_votes = request.kv_votes, None
        if snap and kv_len > bound.budget:
            keep = snapkv_keep(votes_now, bound)  # once, right after the prompt
        elif bound.policy == "h2o" and due:
            keep = h2o_keep(request.kv_votes, bound)
        elif due:
            keep = streaming_keep(kv_len, bound)
        else:
            continue
        tables = kv.reseat(request, kv.blocks_for_tokens(bound.budget))
        if tables is None:
            continue
        request.num_dropped_tokens += kv_len - bound.budget
        if bound.policy == "h2o":  # the kept tokens' accumulated weights move with them
            request.kv_votes = request.kv_votes.gather(-1, keep)
        moves.append(KVMove(tables[0], keep, tables[1]))
    return moves
