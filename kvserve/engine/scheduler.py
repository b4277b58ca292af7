"""Continuous batching with a token budget, chunked prefill and preemption.

One step schedules a flat list of (request, number of new tokens). There is no separate prefill
and decode phase: a request simply has some tokens not yet computed (its prompt, a chunk of it,
or the one token sampled last step), and the scheduler hands out the step's token budget:

1. Running requests first, oldest first, so decodes keep flowing while a long prompt is chunked.
   When the pool cannot hold a running request's next tokens, the youngest running request is
   preempted (its blocks freed, its tokens recomputed later) until it fits.
2. Then waiting requests in arrival order (or longest cached prefix first), while budget,
   sequence slots and blocks last. A request first takes what the prefix cache holds of it, and
   is admitted only when the pool can hold the rest of its tokens, so that admitting it does not
   immediately force a preemption on its next chunk.

The batch carries the step as the worker gets it (`step`: engine/step.py's plain data, built
here, the one place that reads requests and block tables for it), with its `StepPlan` (what the
KV cache must do to memory before the forward); after the forward `update` is the one place
that advances requests' computed tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.bounded_kv import BoundedCaches
from kvserve.engine.step import SeqStep, StepInput
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.plan import StepPlan
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """Requests with more than one new token (prefill chunks) first, then single-token steps."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    step: StepInput = field(default_factory=StepInput)  # seqs[i] is requests[i]'s part

    @property
    def plan(self) -> StepPlan:
        """Executed by the worker before the forward."""
        return self.step.plan

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


def prompt_rows(request: Request, start: int, end: int) -> tuple[int, int] | None:
    """The prompt tokens whose logprobs computing positions [start, end) of `request` yields
    and that it has not recorded yet (a request recomputing its prompt after a preemption
    recorded them the first time), as (first token, count), or None.

    Position p predicts token p + 1, so the last prompt position (which samples) yields no
    prompt logprob, and neither does any output position."""
    if not request.records_prompt_logprobs:
        return None
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(end, len(request.prompt_token_ids) - 1)
    return (first + 1, last - first) if last > first else None


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        assert config.max_num_batched_tokens is not None
        self.config = config
        self.kv = kv
        self.bounded = BoundedCaches(kv)  # bounded KV caches' hooks (engine/bounded_kv.py)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                chosen.append((request, n))
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: everything after it is gone too

        if not preempted:
            self._admit(chosen, budget)

        prefills = [(r, n) for r, n in chosen if n > 1]
        decodes = [(r, n) for r, n in chosen if n == 1]
        ordered = prefills + decodes
        now = time.time()
        for r, _ in ordered:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
        plan = self.kv.end_step()
        return ScheduledBatch([r for r, _ in ordered], [n for _, n in ordered], preempted,
                              StepInput(self._seq_steps(ordered), plan))

    def _seq_steps(self, chosen: list[tuple[Request, int]]) -> list[SeqStep]:
        """The worker's view of each request's part of the step (for every running request,
        every step)."""
        kv = self.kv
        one_group = kv.num_groups == 1
        observe_rows = self.bounded.observe_rows
        seqs = []
        for request, n in chosen:
            start = request.num_computed_tokens
            end = start + n
            token_ids = request.token_ids
            tables = (kv.block_table(request),) if one_group \
                else tuple(kv.group_block_tables(request))
            seqs.append(SeqStep(
                request.request_id, token_ids[start:end], start,
                start - request.num_dropped_tokens, tables,
                end == len(token_ids) and not request.prefill_only,
                prompt_rows(request, start, end), observe_rows(request, start, end)))
        return seqs

    def update(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens are computed, and their full blocks go into
        the prefix cache (so a request arriving next step can hit them)."""
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> None:
        """Admit waiting requests while budget, sequence slots and blocks last.

        A request whose next uncached block is being computed in this very step by another
        request (the same system prompt arriving twice, n > 1 samples) waits one step and then
        hits it, instead of computing it a second time.
        """
        if self.config.scheduling_policy == "lpm" and len(self.waiting) > 1:
            self._order_by_longest_match()
        inflight = self._blocks_in_flight(chosen)
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.kv.prefetch_pending(request):  # its KV is on its way up from disk/Redis
                deferred.append(self.waiting.popleft())
                continue
            match = self.kv.match(request)
            if self._waits_for(request, match, inflight):
                deferred.append(self.waiting.popleft())
                continue
            if not self.running:  # nothing will free a block: a partial hit must not block it
                match = self.kv.unblock(match, request.num_tokens) or match
            remaining = request.num_tokens - match.num_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            admission = self.kv.admit(request, match, n)
            if admission is None:
                break
            request.num_computed_tokens = admission.num_computed_tokens
            if request.num_preemptions == 0:  # a resumed request hitting its own blocks is no news
                request.num_cached_tokens = admission.num_computed_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, n))
            budget -= n
            inflight.update(self.kv.hashes_completed_by(request, n))
        self.waiting.extendleft(reversed(deferred))

    def _blocks_in_flight(self, chosen: list[tuple[Request, int]]) -> set[int]:
        return {h for r, n in chosen for h in self.kv.hashes_completed_by(r, n)}

    def _waits_for(self, request: Request, match: PrefixMatch, inflight: set[int]) -> bool:
        return bool(inflight) and self.kv.next_block_hash(request, match) in inflight

    def _order_by_longest_match(self) -> None:
        """SGLang's "lpm": serve first the waiting requests that reuse the most cached KV
        (stable, so equal matches keep arrival order)."""
        ranked = sorted(self.waiting, key=lambda r: -self.kv.match(r).num_tokens)
        self.waiting = deque(ranked)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and send it back to the front of the queue."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.bounded.reset(request)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
