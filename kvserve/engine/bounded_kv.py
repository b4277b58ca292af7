"""Bounded KV caches as the engine's generic code sees them: one object, `BoundedCaches`, whose
hooks the scheduler calls while it builds a step (`observe_rows`: which rows' attention weights
the backend returns) and when it preempts (`reset`), and the engine after the forward
(`compact`). The policies themselves (what is kept, when) are kvserve.kv.bounded's `BoundedKV`.

Compaction: after the scheduler has advanced a step's requests, each bounded request whose KV
reached its budget plus a block is cut back to its budget: the policy picks the kept tokens, the
manager moves the request onto fresh blocks (`KVCacheManager.reseat`), and the kept tokens' KV
is copied there (`KVTensorPool.compact_tokens`) by the plan handed out right after
(kv/plan.py), which the worker executes like any other plan. A pool too full for the fresh
blocks skips the compaction this step (the request simply holds a little more KV and tries
again next step; SnapKV's one selection is then lost, and the request is bounded like
StreamingLLM from there).

Cost without bounded requests: `observe_rows` is the one call per scheduled request (what the
scheduler made anyway), and `compact` returns at once unless the step scheduled a bounded
request.
"""

from __future__ import annotations

import torch

from kvserve.kv.bounded import add_votes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.seq import kv_length
from kvserve.kv.plan import KVMove
from kvserve.request import Request


class BoundedCaches:
    """The hooks of every request's bounded KV cache (requests without one pass through)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._scheduled = False  # whether the step being built has a bounded request

    def observe_rows(self, request: Request, start: int, end: int) -> tuple[int, int] | None:
        """The rows of the request's chunk [start, end) whose attention weights its policy
        selects by (worker/step.py's SeqStep.observe), or None."""
        bound = request.bounded_kv
        if bound is None:
            return None
        self._scheduled = True
        return bound.observe_rows(len(request.prompt_token_ids), start, end)

    def reset(self, request: Request) -> None:
        """A preempted request recomputes in full, then is bounded again."""
        request.num_dropped_tokens = 0
        request.kv_votes = None

    def compact(self, requests: list[Request], observed: dict[str, list[torch.Tensor]]
                ) -> list[KVMove]:
        """After the step's forward (and `Scheduler.update`): compact what is due; the KV moves
        to make, for the next plan's `compactions`."""
        if not self._scheduled:
            return []
        self._scheduled = False
        return compact_bounded(requests, self.kv, observed)


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
        keep, request.kv_votes = bound.select(kv_len, prompt_done, request.kv_votes,
                                              kv.block_size)
        if keep is None:
            continue
        tables = kv.reseat(request, kv.blocks_for_tokens(bound.budget))
        if tables is None:
            continue
        request.num_dropped_tokens += kv_len - bound.budget
        request.kv_votes = bound.moved_votes(request.kv_votes, keep)
        moves.append(KVMove(tables[0], keep, tables[1]))
    return moves
