"""Document reuse on the scheduler's side: when a request with marked documents is admitted,
are their KV stored, where do they go, and which positions does its step compute.

Where a document's KV lives: in the prefix index, as an ordinary cached prefix. A document's KV
computed behind its anchor (the request's text before its first document, or a fixed short
separator: blend_config `anchor`) is exactly the KV of the prompt `anchor + document`, so an
internal prefill-only request (`DocumentRequest`) computes that prompt (padded to whole blocks;
the anchor is mostly a prefix-cache hit) and publishes its blocks like any request; they are
then content-addressed by their chained token hashes under the requester's cache salt (tenants
stay apart), evicted by the pool's policy, saved to and loaded from the storage tiers, and
counted by the same pool: one prefix cache serves prefixes and documents.

Admission of a request with documents past its prefix hit:
1. each document's blocks are looked up on the device (`KVCacheManager.device_match`); for a
   missing one a DocumentRequest goes in front of the waiting queue (once per document) and
   the request waits a step (`MAX_WAITS` times at most, then it is computed exactly);
2. the step's positions are planned (kvserve/blend/select.py): documents placed, each one's
   first share of tokens, the text between them and the question computed;
3. the documents' blocks are held until the step's plan is handed out (nothing can evict them
   between this admission and the worker's copy) and the plan gets one `TokenPlacement` per
   document: the stored slots, the request's slots, the shift of position.

What stays exact: the request publishes no block from its first placed document on
(`Request.publish_limit`): blended KV, and everything computed on top of it, is never served
to another request as a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.blend.audit import AuditTwin, BlendAuditor
from kvserve.blend.config import BlendConfig
from kvserve.blend.select import BlendPlan, plan_blend
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.plan import StepPlan, TokenPlacement
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.request import Request, RequestStatus
from kvserve.sampling import SamplingParams

DOC_ID_PREFIX = "kvserve-doc-"
MAX_WAITS = 3  # steps a request waits for its documents before it is computed exactly
_PREFILL_ONLY = SamplingParams(max_tokens=0)


@dataclass(eq=False)
class DocumentRequest(Request):
    """The internal request that computes `separator + document` (blocks filled with padding)
    so that its blocks enter the prefix index; it returns no output."""

    key: tuple = ()


@dataclass
class BlendCounters:
    blended_requests: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    documents_computed: int = 0
    fallbacks: int = 0  # requests computed exactly: documents not stored in time, no room

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Blender:
    def __init__(self, config: BlendConfig, kv: KVCacheManager, separator: list[int],
                 pad_token: int) -> None:
        self.config = config
        self.kv = kv
        self.separator = list(separator)
        self.pad = pad_token
        self.enabled = True  # an audit turns it off (kvserve/blend/audit.py)
        self.inflight: dict[tuple, DocumentRequest] = {}
        self.counters = BlendCounters()
        self._held: list[int] = []  # stored blocks read by this step's placements
        self._placements: list[TokenPlacement] = []
        self._pending: dict[str, dict[int, list[int]]] = {}  # chosen, not yet admitted
        self._next_id = 0
        self.auditor = BlendAuditor(config.audit_rate, config.audit_threshold,
                                    config.min_audits) if config.audit_rate > 0 else None

    # -- admission ------------------------------------------------------------------------
    def consider(self, request: Request, match: PrefixMatch, budget: int
                 ) -> tuple[str, BlendPlan | None, list[DocumentRequest]]:
        """("exact", None, []): admit as usual; ("wait", None, new document requests): not
        now; ("blend", plan, []): admit the plan's positions at its cost."""
        if not request.documents or not self.enabled or request.skip_reading_prefix_cache:
            return "exact", None, []
        plan = self._plan(request, match.num_tokens, budget)
        if plan is None:
            return "exact", None, []
        stored = {a: self._stored(request, a, b) for _, _, a in plan.placed
                  for b in [next(e for s, e in request.documents if s == a)]}
        missing = [(a, b) for a, b in request.documents if a in stored and stored[a] is None]
        if not missing and plan.cost <= budget:
            self._hold(request, stored)
            return "blend", plan, []
        request.blend_waits += 1
        if request.blend_waits > MAX_WAITS:
            request.documents = ()
            self.counters.fallbacks += 1
            return "exact", None, []
        return "wait", None, [d for d in (self._document(request, a, b) for a, b in missing)
                              if d is not None]

    def _plan(self, request: Request, start: int, budget: int) -> BlendPlan | None:
        """The step's plan; a "deviation" plan runs every position through the first layers,
        and where the step's budget cannot take them all (chunked prefill's small steps)
        the "first" rule's plan, which computes only the chosen rows, goes instead."""
        c = self.config
        plan = plan_blend(start, request.num_tokens, request.documents, c.recompute_fraction,
                          c.selection)
        if plan is not None and plan.cost > budget and c.selection != "first":
            return plan_blend(start, request.num_tokens, request.documents,
                              c.recompute_fraction, "first")
        return plan

    def admitted(self, request: Request, plan: BlendPlan) -> None:
        """After `KVCacheManager.admit` gave the request its blocks: hold the stored blocks,
        plan the placements, keep the request from publishing blended blocks."""
        bs, sep = self.kv.block_size, len(self._separator(request))
        table = self.kv.block_table(request)
        held = self._pending.pop(request.request_id)
        for first, end, origin in plan.placed:
            blocks = held[origin]
            src = [sep + p - origin for p in range(first, end)]
            self._placements.append(TokenPlacement(
                torch.tensor([blocks[i // bs] * bs + i % bs for i in src], dtype=torch.long),
                torch.tensor([table[p // bs] * bs + p % bs for p in range(first, end)],
                             dtype=torch.long),
                origin - sep))
        if request.num_preemptions == 0:  # reused tokens are served from the cache
            request.num_cached_tokens += plan.reused
            if request.cache_report is not None:
                request.cache_report.documents = {"reused_tokens": plan.reused,
                                                  "recomputed_tokens": plan.recomputed,
                                                  "computed_tokens": plan.computed}
        request.publish_limit = min(a for a, _, _ in plan.placed)
        request.blend_runs = plan.runs
        request.blend_choose = plan.choose or None
        request.blend_counts = (plan.reused, plan.recomputed, plan.computed)
        if self.auditor is not None:
            self.auditor.sample(request)
        c = self.counters
        c.blended_requests += 1
        c.reused_tokens += plan.reused
        c.recomputed_tokens += plan.recomputed
        c.computed_tokens += plan.computed

    def _hold(self, request: Request, stored: dict[int, PrefixMatch]) -> None:
        """Hold the documents' blocks from the moment they are chosen: the request's own
        admission allocates, and could otherwise evict them (released with the plan)."""
        held = {}
        for origin, match in stored.items():
            blocks = [n.block for n in match.nodes]
            self.kv.pool.share(blocks)
            self.kv.index.touch(match.nodes, request.priority)
            self._held.extend(blocks)
            held[origin] = blocks
        self._pending[request.request_id] = held

    def end_step(self, plan: StepPlan) -> None:
        """The scheduler handed out the step's plan: its placements go with it, and the stored
        blocks they read can be let go (the plan runs before anything allocates again)."""
        plan.placements.extend(self._placements)
        self._placements = []
        self._pending.clear()  # (a request whose admission failed after all)
        if self._held:
            self.kv.index.mark_idle(self.kv.pool.release(self._held))
            self._held = []

    # -- documents ------------------------------------------------------------------------
    def _separator(self, request: Request) -> list[int]:
        """What a document is computed behind (blend_config anchor, config.py says why)."""
        first = request.documents[0][0]
        if self.config.anchor == "prefix" and first > 0:
            return request.token_ids[:first]
        return self.separator

    def _padded(self, request: Request, start: int, end: int) -> list[int]:
        tokens = self._separator(request) + request.token_ids[start:end]
        bs = self.kv.block_size
        return tokens + [self.pad] * (-len(tokens) % bs)

    def _stored(self, request: Request, start: int, end: int) -> PrefixMatch | None:
        """The device blocks holding the document's KV (all of them), or None."""
        tokens = self._padded(request, start, end)
        # (the index never serves a sequence's last token: one more is asked for)
        probe = Request("probe", tokens + [self.pad], _PREFILL_ONLY, 0,
                        cache_salt=request.cache_salt)
        match = self.kv.device_match(probe)
        need = len(tokens) // self.kv.block_size
        return match if len(match.nodes) >= need else None

    def _document(self, request: Request, start: int, end: int) -> DocumentRequest | None:
        tokens = self._padded(request, start, end)
        key = (request.cache_salt, tuple(tokens))
        if key in self.inflight:
            return None
        doc = DocumentRequest(f"{DOC_ID_PREFIX}{self._next_id}", tokens, _PREFILL_ONLY,
                              max_tokens=0, cache_salt=request.cache_salt,
                              priority=request.priority, tenant=request.tenant, key=key)
        self._next_id += 1
        self.inflight[key] = doc
        return doc

    def seq_step(self, seq, request: Request):
        """The worker's view (worker/step.py's SeqStep, not imported: the worker package sits
        above this one) of a blended request's step: its runs' tokens, one after another, and
        the runs (worker/model_runner.py makes a slice of each), and with "deviation" the
        spans chosen from after the check layer (worker/row_select.py)."""
        tokens = request.token_ids
        runs = request.blend_runs
        seq.token_ids = [t for a, b in runs for t in tokens[a:b]]
        seq.runs = tuple((a, b - a) for a, b in runs)
        if request.blend_choose is not None:
            seq.choose = request.blend_choose
            seq.check_layer = self.config.check_layer
        return seq

    def internal(self, request: Request) -> bool:
        """Whether `request` is the engine's own (a document request or an audit twin)."""
        return isinstance(request, (DocumentRequest, AuditTwin))

    def take_spawned(self) -> list[Request]:
        """Audit twins queued since the last step (they wait behind user requests)."""
        return self.auditor.take_spawned() if self.auditor is not None else []

    def observe(self, twin: AuditTwin, logprobs: dict[int, float] | None) -> None:
        """An audit twin sampled its token (the scheduler finished it, without output)."""
        if self.auditor is not None and self.auditor.observe(twin, logprobs) is False:
            self.enabled = False

    def drop_failed(self, scheduler, requests: list[Request], failed: dict) -> None:
        """Internal requests that failed in a step: finished here, never reported."""
        for request in requests:
            if self.internal(request) and request.request_id in failed:
                del failed[request.request_id]
                self.forget(request)
                if not request.finished:
                    scheduler.finish(request, RequestStatus.FINISHED_ERROR)

    def stats(self) -> dict:
        out: dict = self.counters.as_dict()
        out["enabled"] = int(self.enabled)
        if self.auditor is not None:
            out["audits"] = self.auditor.state.audits
            out["audit_divergence_mean"] = self.auditor.state.mean
        return out

    def complete(self, request: Request) -> bool:
        """Whether `request` is a document request (whose blocks are now published): the
        caller finishes it, without output."""
        if not isinstance(request, DocumentRequest):
            return False
        if self.inflight.pop(request.key, None) is not None:
            self.counters.documents_computed += 1
        return True

    def forget(self, request: Request) -> None:
        """An internal request that ended otherwise (aborted, failed): a document may be
        asked for again, an audit is dropped."""
        if isinstance(request, DocumentRequest):
            self.inflight.pop(request.key, None)
        elif isinstance(request, AuditTwin) and self.auditor is not None:
            self.auditor.forget(request)


def build_blender(config: BlendConfig | None, kv: KVCacheManager, tokenizer) -> Blender | None:
    """The scheduler's Blender for `blend_config` (None: off). The separator is the text a
    document is computed behind: a newline, after the tokenizer's BOS where it adds one (the
    position every prompt's first token takes); documents are padded with the pad token
    (else an end-of-sequence token) to whole blocks."""
    if config is None:
        return None
    separator = tokenizer.encode("\n", add_special_tokens=True)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return Blender(config, kv, separator, pad)
