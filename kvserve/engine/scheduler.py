"""Continuous batching with a token budget, chunked prefill and preemption.

One step schedules a flat list of (request, number of new tokens). There is no separate prefill
and decode phase: a request simply has some tokens not yet computed (its prompt, a chunk of it,
or the one token sampled last step), and the scheduler hands out the step's token budget:

1. Running requests first, oldest first, so decodes keep flowing while a long prompt is chunked.
   When the pool cannot hold a running request's next tokens, the youngest running request is
   preempted (its blocks freed, its tokens recomputed later, or its KV swapped out to host
   memory and back in when it resumes: kv/swap.py) until it fits.
2. Then waiting requests in arrival order (or longest cached prefix first), while budget,
   sequence slots and blocks last. A request first takes what the prefix cache holds of it, and
   is admitted only when the pool can hold the rest of its tokens, so that admitting it does not
   immediately force a preemption on its next chunk.

The batch carries the step as the worker gets it (`step`: worker/step.py's plain data, built
here, the one place that reads requests and block tables for it), with its `StepPlan` (what the
KV cache must do to memory before the forward); after the forward `update_from_output` is the
one place that advances requests: computed tokens, the sampled token appended, the token stops
(EOS, stop token ids, grammar end, lengths) checked, finished requests freed. Stop strings need
the text, so the engine's output processor checks them and finishes through `finish`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import EngineConfig
from kvserve.blend.blender import Blender
from kvserve.engine.audit import Auditor
from kvserve.engine.bounded_kv import BoundedCaches
from kvserve.engine.stats import EngineStats
from kvserve.engine.step_message import grammar_bitmask, seq_steps
from kvserve.worker.step import StepInput, StepOutput
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.events import KVEvent
from kvserve.kv.pins import Pin
from kvserve.kv.plan import StepPlan
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.kv.report import build_report
from kvserve.kv.retention import retain_sequence
from kvserve.kv.swap import SwapSpace
from kvserve.kv.tiers.stats import SOURCES
from kvserve.request import Request, RequestStatus
from kvserve.spec.speculator import Speculator

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvserve")


@dataclass
class ScheduledBatch:
    """Requests with more than one new token (prefill chunks) first, then single-token steps."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    step: StepInput = field(default_factory=StepInput)  # seqs[i] is requests[i]'s part
    failed: dict[str, Exception] = field(default_factory=dict)  # by parent id, before the step
    num_drafted: int = 0  # speculative decoding: drafted tokens in the step
    has_prefill: bool = False  # a row computes more than one verified token (a prompt chunk)

    @property
    def plan(self) -> StepPlan:
        """Executed by the worker before the forward."""
        return self.step.plan

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepUpdate:
    """What a step's output did to its requests (Scheduler.update_from_output)."""

    # (request, its new token, whether the text should see it: not an EOS or stop token id)
    appended: list[tuple[Request, int, bool]] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)  # by parent id
    prefilled: list[str] = field(default_factory=list)  # parents of finished prefill-only ones
    speculated: bool = False  # some request appended kept drafts: several tokens this step


@dataclass(frozen=True)
class SchedulerHooks:
    """The scheduler's optional collaborators, each built by the engine from its config (None:
    off). Given at construction, so a scheduler is whole from its first line and no one
    rewires it afterwards (tests/test_architecture.py checks that nothing assigns to a
    scheduler's attributes from outside)."""

    audit: Auditor | None = None  # hit audits (engine/audit.py)
    swap: SwapSpace | None = None  # swap preemption (kv/swap.py)
    spec: Speculator | None = None  # speculative decoding (kvserve/spec/)
    blend: Blender | None = None  # document reuse (kvserve/blend/)
    vocab_size: int | None = None  # the grammar bitmask's width (None: no grammar rows)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 hooks: SchedulerHooks = SchedulerHooks()) -> None:
        assert config.max_num_batched_tokens is not None
        self.config = config
        self.kv = kv
        self.bounded = BoundedCaches(kv)  # bounded KV caches' hooks (engine/bounded_kv.py)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # prompt tokens missed by the requests that asked for a cache report, by reason
        self.missed_tokens: Counter[str] = Counter()
        self._finished_ids: list[str] = []  # for the next step: the worker drops their state
        self.vocab_size = hooks.vocab_size
        self.audit, self.swap, self.spec, self.blend = \
            hooks.audit, hooks.swap, hooks.spec, hooks.blend

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_all(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = 0
        if self.audit is not None:
            self.audit.give_way(self)  # a running audit yields to waiting requests

        i = 0
        allocate = self.kv.allocate_slots
        spec = self.spec if self.spec is not None and self.spec.active(len(self.running)) \
            else None
        # drafted rows the step may add (Speculator.draft_rows: the one-call decode's limit)
        spare = spec.draft_rows(len(self.running)) if spec is not None else 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(len(request.token_ids) - request.num_computed_tokens, budget,
                    self._prefill_cap())  # uncomputed
            if spare > 0 and n == 1:  # a decode: it may draft (never preempting for it)
                drafted = self._draft(spec, request, min(budget - 1, spare))
                n += drafted
                spare -= drafted
            while not allocate(request, n):
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
            if self.blend is not None:
                self.waiting.extend(self.blend.take_spawned())  # audit twins, behind users
            if self.audit is not None:
                self.audit.schedule(self, chosen)  # with what the step has left

        now = time.time()
        prefills: list[tuple[Request, int]] = []
        decodes: list[tuple[Request, int]] = []
        num_drafted, has_prefill = 0, False
        for chosen_one in chosen:
            r, n = chosen_one
            # a verification is decode rows (worker/model_runner.py): with the decodes, after
            # every prefill chunk
            (prefills if n > 1 and not r.draft_token_ids else decodes).append(chosen_one)
            if r.draft_token_ids:
                num_drafted += len(r.draft_token_ids)
            else:
                has_prefill |= n > 1
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
        ordered = prefills + decodes if prefills else decodes
        plan = self.kv.end_step()
        requests = [r for r, _ in ordered]
        seqs = seq_steps(self.kv, self.bounded, ordered)
        if self.blend is not None:
            self.blend.end_step(plan)
            for i, r in enumerate(requests):
                if r.blend_runs is not None:
                    seqs[i] = self.blend.seq_step(seqs[i], r)
        step = StepInput(seqs, plan, self.take_finished())
        batch = ScheduledBatch(requests, [n for _, n in ordered], preempted, step,
                               num_drafted=num_drafted, has_prefill=has_prefill)
        if self.vocab_size is not None and any(r.grammar is not None for r in requests):
            grammar_bitmask(requests, step, self.vocab_size, batch.failed)
        return batch

    def _draft(self, spec: Speculator, request: Request, room: int) -> int:
        """Draft tokens for a decoding request, within `room` (the step's budget), its
        max_tokens and the context, and only if its blocks can hold them without preempting
        anyone; returns how many. A request with a grammar or a bounded cache drafts none
        (not supported yet: it decodes one token a step, exactly as without speculation)."""
        room = min(room, request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        if room <= 0 or request.grammar is not None or request.bounded_kv is not None:
            return 0
        draft = spec.propose(request, room)
        if draft and not self.kv.allocate_slots(request, 1 + len(draft)):
            draft = []
        request.draft_token_ids = draft
        return len(draft)

    def update(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens are computed, and their full blocks go into
        the prefix cache (so a request arriving next step can hit them)."""
        bs = self.kv.block_size
        publish = self.kv.cache_full_blocks
        for request, n in zip(batch.requests, batch.num_new_tokens):
            n -= len(request.draft_token_ids)  # drafts count once verified (update_from_output)
            request.blend_runs = None  # (a blended admission's runs: this step's only)
            computed = request.num_computed_tokens + n
            request.num_computed_tokens = computed
            if n > 1 or computed % bs == 0:  # one token completes a block only at its end
                publish(request)
                if request.sampling_params.kv_retention is not None \
                        and computed - n < len(request.prompt_token_ids):
                    self._retain(request)  # a retention covers prompt blocks only

    def _retain(self, request: Request) -> None:
        retain_sequence(self.kv, request, request.sampling_params.kv_retention,
                        len(request.prompt_token_ids))

    def update_from_output(self, batch: ScheduledBatch, out: StepOutput) -> StepUpdate:
        """After the forward: computed tokens advance (`update`), prompt logprobs are recorded,
        prefill-only requests whose prompt is done finish, and each sampled token is appended
        and checked against the token stops; finished requests are freed. Request by request:
        one that raises fails alone (its parent id in `failed`), the others go on."""
        self.update(batch)
        now = time.time()
        result = StepUpdate(failed=dict(batch.failed))
        failed = result.failed
        self._record_prompt_logprobs(batch, out, failed)
        for request in batch.requests:
            if request.max_tokens == 0 and request.num_computed_tokens >= request.num_tokens \
                    and not request.finished:  # a prefill-only request whose prompt is done
                if self.audit is not None and self.audit.complete(request) or \
                        self.blend is not None and self.blend.complete(request):
                    self.finish(request, RequestStatus.FINISHED_LENGTH)  # internal: no output
                    continue
                parent = request.parent_id or request.request_id
                if parent not in failed:
                    request.first_token_time = request.last_token_time = now
                    self.finish(request, RequestStatus.FINISHED_LENGTH)
                    result.prefilled.append(parent)
        for request_id, exc in out.failed.items():
            request = batch.requests[next(i for i, s in enumerate(batch.step.seqs)
                                          if s.request_id == request_id)]
            failed.setdefault(request.parent_id or request.request_id, exc)
        requests, appended, append = batch.requests, result.appended, self._append
        for i, token, logprobs in zip(out.sampled, out.tokens, out.logprobs):
            request = requests[i]
            if token is None or (failed and (request.parent_id or request.request_id) in failed):
                continue
            if self.blend is not None and self.blend.internal(request):  # an audit twin
                append(request, token, logprobs, now)  # (max_tokens 1: this finishes it)
                self.blend.observe(request, logprobs)
                continue
            try:
                if request.draft_token_ids:
                    accepted = out.accepted.get(i)
                    result.speculated |= accepted is not None
                    if not self._accept(request, accepted, appended, now):
                        continue  # a kept draft ended it
                appended.append((request, token, append(request, token, logprobs, now)))
            except Exception as exc:  # this request's own fault: it alone fails
                failed[request.parent_id or request.request_id] = exc
            if request.draft_token_ids:
                self._settle_drafts(request)
        if self.blend is not None and failed:
            self.blend.drop_failed(self, batch.requests, failed)  # its own: no output
        return result

    def _accept(self, request: Request, accepted: tuple[list[int], list] | None,
                appended: list[tuple[Request, int, bool]], now: float) -> bool:
        """Append the drafts the verification kept, each as if sampled in a step of its own
        (token stops checked; its KV, computed and now verified, counted and published when it
        completes a block); whether the request goes on."""
        tokens, logprobs = accepted if accepted is not None else ([], [])
        assert self.spec is not None
        self.spec.record(request, len(request.draft_token_ids), len(tokens))
        bs, publish = self.kv.block_size, self.kv.cache_full_blocks
        for token, lp in zip(tokens, logprobs):
            appended.append((request, token, self._append(request, token, lp, now)))
            if request.finished:
                return False
            request.num_computed_tokens += 1
            if request.num_computed_tokens % bs == 0:
                publish(request)
        return True

    def _settle_drafts(self, request: Request) -> None:
        """After a verification: the blocks that held only rejected drafts go back to the
        pool (the request's length is its kept tokens' already)."""
        request.draft_token_ids = []
        if not request.finished:
            self.kv.trim(request, request.num_tokens)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, out: StepOutput,
                                failed: dict[str, Exception]) -> None:
        """Append to each request the logprobs of the prompt tokens this step predicted (the
        scheduler asked only for the ones not recorded yet, so a prompt recomputed after a
        preemption neither repeats nor loses an entry)."""
        for span, (entries, ranks) in zip(out.prompt_spans, out.prompt_logprobs):
            request = batch.requests[span.index]
            if request.request_id in out.failed:
                continue
            try:
                assert len(request.prompt_logprobs) == span.first_token, \
                    "prompt logprobs out of step"
                request.prompt_logprobs.extend(entries)
                request.prompt_logprob_ranks.extend(ranks)
            except Exception as exc:
                failed[request.parent_id or request.request_id] = exc

    def _append(self, request: Request, token: int, logprobs: dict[int, float] | None,
                now: float) -> bool:
        """Append the token; finish the request if a token stop ends it. Returns whether its
        text should see the token (False after an EOS or stop token id)."""
        token_ids = request.token_ids
        token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token]
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token):
            raise ValueError(f"token {token} is not allowed by the request's grammar")
        params = request.sampling_params
        n_out = len(token_ids) - len(request.prompt_token_ids)
        if n_out >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return False
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return False
        if n_out >= request.max_tokens or len(token_ids) >= self.config.max_model_len:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
        elif grammar is not None and grammar.terminated:
            self.finish(request, RequestStatus.FINISHED_STOPPED)  # its grammar has ended
        return True

    def _prefill_cap(self) -> int | float:
        """The most tokens of one prompt a step computes (long_prefill_token_threshold, with
        chunked prefill): a long prompt's activations are then bounded by the cap's rows,
        not the prompt's length, while the step's budget still fills with other requests."""
        cap = self.config.long_prefill_token_threshold
        return cap if cap and self.config.enable_chunked_prefill else float("inf")

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> None:
        """Admit waiting requests while budget, sequence slots and blocks last.

        A request whose next uncached block is being computed in this very step by another
        request (the same system prompt arriving twice, n > 1 samples) waits one step and then
        hits it, instead of computing it a second time.
        """
        if not self.waiting:
            return
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
            if self.swap is not None and request.request_id in self.swap:  # swapped out
                match = self.swap.resume(request, self.kv.device_match(request)) or match
            if not self.running:  # nothing will free a block: a partial hit must not block it
                match = self.kv.unblock(match, request.num_tokens) or match
            blend = None
            if request.documents and self.blend is not None:  # kvserve/blend/
                verdict, blend, documents = self.blend.consider(request, match, budget)
                if verdict == "wait":  # its documents are computed first
                    deferred.append(self.waiting.popleft())
                    self.waiting.extendleft(reversed(documents))
                    continue
            remaining = request.num_tokens - match.num_tokens
            n = min(remaining, budget, self._prefill_cap()) if blend is None else remaining
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            # The cache report, for a request that asked: decided here, before admission
            # changes the index (read-only; nothing of it runs for other requests).
            sp = request.sampling_params
            report = build_report(self.kv, request, match, request.skip_reason,
                                  sp.kv_cache_report_full) \
                if sp.kv_cache_report and request.num_preemptions == 0 else None
            admission = self.kv.admit(request, match, n)
            if admission is None:
                break
            request.num_computed_tokens = admission.num_computed_tokens
            if self.swap is not None:
                self.swap.admitted(request.request_id, match)
            if request.sampling_params.kv_retention is not None:
                self._retain(request)
            if request.num_preemptions == 0:  # a resumed request hitting its own blocks is no news
                request.num_cached_tokens = admission.num_computed_tokens
                if report is not None:
                    request.cache_report = report
                    self.missed_tokens[report.reason] += report.missed_tokens
            if blend is not None:
                self.blend.admitted(request, blend)
            if self.audit is not None:
                self.audit.sample(request, match)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, n))
            budget -= n if blend is None else blend.cost
            inflight.update(self.kv.hashes_completed_by(request, n))
        self.waiting.extendleft(reversed(deferred))

    def _blocks_in_flight(self, chosen: list[tuple[Request, int]]) -> set[int]:
        return {h for r, n in chosen
                for h in self.kv.hashes_completed_by(r, n - len(r.draft_token_ids))}

    def _waits_for(self, request: Request, match: PrefixMatch, inflight: set[int]) -> bool:
        return bool(inflight) and self.kv.next_block_hash(request, match) in inflight

    def _order_by_longest_match(self) -> None:
        """SGLang's "lpm": serve first the waiting requests that reuse the most cached KV
        (stable, so equal matches keep arrival order)."""
        ranked = sorted(self.waiting, key=lambda r: -self.kv.match(r).num_tokens)
        self.waiting = deque(ranked)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and send it back to the front of the queue (an
        audit is given up instead: it must never wait ahead of user requests)."""
        if self.audit is not None and self.audit.abandon(request):
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            return
        self.running.remove(request)
        if self.swap is not None:
            out = self.swap.swap_out(self.kv, request, request.bounded_kv is not None)
            if out is not None:
                self.kv.plan_swap_out(out)  # read before anything can reuse its blocks
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        self.bounded.reset(request)
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def take_finished(self) -> list[str]:
        """The requests that ended since the last step (the worker drops their state)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    # -- the KV manager's other changes, asked for by the engine ---------------------------
    # Only the scheduler (and the hooks it was built with) drives the KV manager
    # (tests/test_architecture.py), so that every change to what the cache holds has one
    # owner that also knows the queues.
    def end_step(self) -> StepPlan:
        """What the KV cache planned since the last plan (saves, loads, copies), handed out
        once (kv/manager.py: `end_step`)."""
        return self.kv.end_step()

    def start_prefetch(self, request: Request, peer: str | None = None) -> None:
        """Start reading the tier chunks a new request will hit (`peer`: another instance's,
        disaggregation), so they are in host memory when it is admitted."""
        self.kv.start_prefetch(request, peer)

    def wait_for_prefetch(self, seconds: float) -> bool:
        """Wait up to `seconds` for a tier read a waiting request needs; whether one landed."""
        return self.kv.wait_for_prefetch(seconds)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep their blocks."""
        self.kv.reset_prefix_cache()

    def drain_kv_events(self) -> tuple[list[KVEvent], int]:
        """The prefix index's events since the last drain, and how many were dropped."""
        return self.kv.drain_events()

    def pin(self, probe: Request, num_tokens: int, owner: str) -> Pin | None:
        """Pin the cached blocks of `probe`'s first `num_tokens` (kv/pins.py)."""
        return self.kv.pins.pin(probe, num_tokens, owner)

    def unpin(self, pin_id: str, owner: str | None) -> Pin | None:
        """Release a pin (None: no such pin of `owner`'s)."""
        return self.kv.pins.unpin(pin_id, owner)

    def save_chunks(self, saved: list[tuple[int, torch.Tensor]]) -> None:
        """Hand the chunks the worker read to the tiers. Best-effort: a chunk that is not
        saved is recomputed later."""
        for chunk_hash, data in saved:
            try:
                self.kv.tiers.save(chunk_hash, data)
            except Exception:
                logger.exception("saving chunk %x to the tiers failed; it is skipped",
                                 chunk_hash)

    def close_tiers(self) -> None:
        """Stop the tier link's threads (engine shutdown, after its last plan ran)."""
        self.kv.tiers.close()

    def check_invariants(self) -> None:
        """Debug check run by the tests after every step: queues, tables and pool agree."""
        live = list(self.running) + list(self.waiting)
        assert len({r.request_id for r in live}) == len(live), "a request is queued twice"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING
            assert r.request_id not in self.kv.block_tables, "a waiting request holds blocks"
        assert len(self.running) <= self.config.max_num_seqs
        self.kv.check_invariants(live)
        if self.swap is not None:
            self.swap.check_invariants({r.request_id for r in self.waiting})

    def stats(self) -> EngineStats:
        """A snapshot of the gauges and counters every stats reader shares (see EngineStats)."""
        kv = self.kv
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_evicted_blocks=kv.num_evicted_blocks,
            hit_tokens={source: kv.hit_tokens[source] for source in SOURCES},
            missed_tokens=dict(self.missed_tokens),
            num_pins=len(kv.pins), num_pinned_blocks=kv.pins.num_pinned_blocks,
            idle_blocks_by_tenant=dict(kv.pool.idle_by_tenant),  # zeros too: gauges go back
            audits=self.audit.stats() if self.audit is not None else {},
            swap=self.swap.stats.as_dict() if self.swap is not None else {},
            spec_decode=self.spec.counters.as_dict() if self.spec is not None else {},
            blend=self.blend.stats() if self.blend is not None else {})

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its blocks (and, with the next step,
        what the worker kept of it)."""
        request.status = status
        request.finished_time = time.time()
        request.draft_token_ids = []
        if request.worker_has_state:
            self._finished_ids.append(request.request_id)
            request.worker_has_state = False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        if self.swap is not None:
            self.swap.drop(request.request_id)
        if self.spec is not None:
            self.spec.release(request)
