"""Hit audits (`--kv-audit-rate R`): a sampled fraction of prefix-cache hits is recomputed and
compared with the KV the cache served.

Why: a cached block is trusted for as long as it stays in the prefix index. KV written wrong
once (a kernel bug, a tier load whose bytes were bad, memory corruption) would be served to
every later request with that prefix, silently and for ever. An audit finds such a block and
takes it out, so that the next request computes it again.

How: at admission, a device hit is sampled with probability R (one draw of a generator seeded
with the engine's seed: runs repeat). The job records the hit's matched blocks, in every KV
group, and their tokens. Later, on a step with room to spare, an internal request computes that
prefix from scratch: prefill only, reading nothing from the cache, publishing nothing into it
(its cursors are removed at admission, as `KVCacheManager.reseat` does for bounded caches), not
counted in the hit statistics and returning no output. Once its prompt is computed, before its
blocks are freed, the worker compares each recomputed block with the cached block the hit read
(`Executor.compare_kv_blocks`: the engine holds no KV of its own). A block further apart than
recomputation in another batch can move it (`TOLERANCES`, by storage format) is a mismatch: it
is counted, logged with its hash, and dropped from the index with everything below it (the
blocks after it may have been computed on top of it). The whole hit is checked, so a corrupted
block is caught with probability R by each hit that reads it: within 1/R such hits on average.

Off the hot path: with R = 0 there is no Auditor (the scheduler tests one attribute per admitted
request and per step). With R > 0 an audit starts only when nothing waits, the step has token
budget left after every user request and sequence slots to spare, and the pool has at least
twice the audit's blocks available; at most one runs at a time. One whose prefix takes several
steps gives way as soon as a request waits (it is retried once), and one that the pool must
preempt is dropped, not requeued. Only a few jobs wait (`MAX_PENDING`): extra samples are
counted as skipped, as are jobs whose blocks left the cache before their audit ran.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvserve.config import EngineConfig
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_index import Node, PrefixIndex, PrefixMatch
from kvserve.kv.tiers.link import TieredMatch
from kvserve.request import Request, RequestStatus
from kvserve.sampling import SamplingParams

if TYPE_CHECKING:
    from kvserve.worker.executor import Executor

logger = logging.getLogger("kvserve")

AUDIT_ID_PREFIX = "kvserve-audit-"  # user request ids may not start with it while audits are on
MAX_PENDING = 4  # sampled hits waiting for their audit; more are skipped

# (largest, mean) difference over the block's magnitude that recomputing it in another batch
# (other chunk boundaries, other kernels' summation order) may show, by storage format. fp32 is
# all but exact (about 1e-6); bf16 and fp16 keep 2^-8 and 2^-11 of each value, and every layer
# above the first sees inputs rounded so too. A quantized format may move a value by a whole
# rounding step where its input barely moved: 1/255 of a group's range (int8), 1/8 or 1/4 of
# the value (fp8 e4m3, e5m2), 1/15 of the range (int4, whose filling block's keys are also read
# at full precision by the request that computes it); few values sit near a step, so the mean
# stays small. Measured on the tests' models with chunked prefill: bf16 0.007 / 0.001, int4
# 0.11 / 0.02. Corruption (garbage bytes, zeros, another block's KV) is of the block's own
# scale, and non-finite KV is always a mismatch.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-3, 1e-4),
    "fp16": (0.05, 0.01),
    "bf16": (0.1, 0.02),
    "int8": (0.1, 0.02),
    "fp8": (0.35, 0.08),
    "int4": (0.4, 0.1),
    "fp8_e5m2": (0.6, 0.15),
}

_PREFILL_ONLY = SamplingParams(max_tokens=0)


@dataclass
class AuditJob:
    """A sampled hit, as admission served it."""

    request_id: str  # the request that hit (for the log)
    tokens: list[int]  # the prefix its full-block hit covered
    cache_salt: str | None
    nodes: list[list[Node]]  # per KV group, the matched nodes, root first
    blocks: list[list[int]]  # their block ids then (a node's block may change: windowed caches)
    retried: bool = False  # its audit gave way to waiting requests once (`give_way`)


class _Pair(NamedTuple):
    """One audited block: its depth in the hit, its KV group, its node, the block the hit read
    and the audit's recomputed block."""

    depth: int
    group: int
    node: Node
    cached: int
    ours: int


@dataclass(eq=False)
class AuditRequest(Request):
    """The internal request that recomputes an audited prefix: it reads nothing from the
    prefix cache (so it is no query either), and the Auditor keeps it from publishing."""

    job: AuditJob | None = None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return True

    @property
    def skip_reason(self) -> str | None:
        return "audit"


class Auditor:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, executor: "Executor",
                 kv_format: str) -> None:
        """`kv_format`: the KV storage format's name (kv/spec.py's KV_DTYPES), which sets the
        tolerance."""
        assert config.max_num_batched_tokens is not None
        self.rate = config.kv_audit_rate
        self.rng = random.Random(config.seed)
        self.kv = kv
        self.executor = executor
        self.step_tokens = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.max_num_seqs = config.max_num_seqs
        self.tolerance = TOLERANCES[kv_format]
        self.pending: deque[AuditJob] = deque()
        self.running: AuditRequest | None = None
        self._next_id = 0
        self.audited_hits = 0  # audits that compared at least one block
        self.audited_blocks = 0  # blocks compared
        self.mismatches = 0  # blocks whose cached KV differed from the recomputed one
        self.dropped_blocks = 0  # blocks taken out of the index for it (a mismatch's subtree)
        self.skipped = 0  # sampled hits not audited: queue full, blocks gone, preempted, failed

    def stats(self) -> dict[str, int]:
        return {"audited_hits": self.audited_hits, "audited_blocks": self.audited_blocks,
                "mismatches": self.mismatches, "dropped_blocks": self.dropped_blocks,
                "skipped": self.skipped}

    # -- at admission ---------------------------------------------------------------------------
    def sample(self, request: Request, match: PrefixMatch) -> None:
        """Right after `request` was admitted with `match`: maybe keep the hit for an audit.
        Only device hits of a request's first admission (a resumed one hits its own blocks);
        a hit partly loaded from the storage tiers is left to their checksums
        (kv/tiers/chunk.py)."""
        if not match.nodes or isinstance(match, TieredMatch) or request.num_preemptions \
                or isinstance(request, AuditRequest) or self.rng.random() >= self.rate:
            return
        if len(self.pending) >= MAX_PENDING:
            self.skipped += 1
            return
        groups = match.group_nodes if match.group_nodes is not None else [match.nodes]
        self.pending.append(AuditJob(
            request.request_id, request.token_ids[:len(match.nodes) * self.kv.block_size],
            request.cache_salt, [list(nodes) for nodes in groups],
            [[n.block for n in nodes] for nodes in groups]))

    # -- starting one ---------------------------------------------------------------------------
    def schedule(self, scheduler, chosen: list[tuple[Request, int]]) -> None:
        """After the step's admissions: start the next audit if nothing waits and the step and
        the pool have room to spare (else it waits for such a step). `scheduler`: the engine's
        Scheduler, whose running list the audit joins."""
        if not self.pending or self.running is not None or scheduler.waiting \
                or len(scheduler.running) >= self.max_num_seqs:
            return
        kv = self.kv
        job = self.pending[0]
        need = kv.blocks_for_tokens(len(job.tokens)) * kv.num_groups
        if 2 * need > kv.num_blocks or not self._pairs(job, None):  # never room / nothing left
            self.pending.popleft()
            self.skipped += 1
            return
        spare = self.step_tokens - sum(n for _, n in chosen)
        n = min(len(job.tokens), spare)
        if n <= 0 or (n < len(job.tokens) and not self.chunked) \
                or kv.num_available_blocks < 2 * need:
            return
        request = AuditRequest(self._new_id(), job.tokens, _PREFILL_ONLY, max_tokens=0,
                               cache_salt=job.cache_salt, job=job)
        if kv.admit(request, PrefixMatch([], block_size=kv.block_size), n) is None:
            return
        self.pending.popleft()
        for g in kv.groups:  # publishes nothing: its blocks are for the comparison only
            g.cursors.pop(request.request_id, None)
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        chosen.append((request, n))
        self.running = request

    def give_way(self, scheduler) -> None:
        """Before the step is scheduled: an audit still computing its prefix (chunked over
        several steps) gives way to requests that wait, so that it never takes their budget:
        it is given up, and its job is tried once more when nothing waits."""
        audit = self.running
        if audit is None or not scheduler.waiting:
            return
        self.running = None
        scheduler.finish(audit, RequestStatus.FINISHED_ABORTED)
        if audit.job.retried:
            self.skipped += 1
        else:
            audit.job.retried = True
            self.pending.appendleft(audit.job)

    def _new_id(self) -> str:
        while True:
            rid = f"{AUDIT_ID_PREFIX}{self._next_id}"
            self._next_id += 1
            if rid not in self.kv.block_tables:
                return rid

    def abandon(self, request: Request) -> bool:
        """Whether `request` is the running audit; if so it is given up (the pool is short:
        the caller finishes it instead of preempting it)."""
        if request is not self.running or self.running is None:
            return False
        self.running = None
        self.skipped += 1
        return True

    def abort(self, request_id: str) -> AuditRequest | None:
        """The running audit if it has this id, given up (the caller finishes it), else None."""
        audit = self.running
        if audit is None or audit.request_id != request_id:
            return None
        self.abandon(audit)
        return audit

    # -- comparing ------------------------------------------------------------------------------
    def complete(self, request: Request) -> bool:
        """Whether `request` is the running audit, whose prompt is now computed: if so compare
        its blocks with the cached ones (the caller then finishes it, freeing its blocks)."""
        if request is not self.running or self.running is None:
            return False
        self.running = None
        job = request.job
        try:
            self._compare(job, self.kv.group_block_tables(request))
        except Exception:  # an audit is best-effort: the request it checks has been served
            logger.exception("KV audit of the prefix hit of request %s failed; skipped",
                             job.request_id)
            self.skipped += 1
        return True

    def _pairs(self, job: AuditJob, tables: list[list[int]] | None) -> list[_Pair]:
        """Each audited block still cached where the hit found it (and, given the audit's
        `tables`, still held by the audit: a windowed group releases blocks)."""
        out = []
        for g, (nodes, blocks) in enumerate(zip(job.nodes, job.blocks)):
            index = self.kv.groups[g].index
            if not isinstance(index, PrefixIndex):
                continue
            for depth, (node, block) in enumerate(zip(nodes, blocks)):
                if node.dropped or node.block != block or block == NULL_BLOCK \
                        or index._node_of_block.get(block) is not node:
                    continue  # evicted (its block may hold other KV now), reset or dropped
                ours = NULL_BLOCK if tables is None else tables[g][depth]
                if tables is None or ours != NULL_BLOCK:
                    out.append(_Pair(depth, g, node, block, ours))
        return out

    def _compare(self, job: AuditJob, tables: list[list[int]]) -> None:
        pairs = self._pairs(job, tables)
        if not pairs:
            self.skipped += 1
            return
        diffs = self.executor.compare_kv_blocks([(p.ours, p.cached) for p in pairs])
        self.audited_hits += 1
        self.audited_blocks += len(pairs)
        max_tol, mean_tol = self.tolerance
        bad = [(p, d) for p, d in zip(pairs, diffs) if d[0] > max_tol or d[1] > mean_tol]
        self.mismatches += len(bad)
        for g in sorted({p.group for p, _ in bad}):
            # the shallowest mismatch: what follows it goes with it
            p, (max_diff, mean_diff) = min(((p, d) for p, d in bad if p.group == g),
                                           key=lambda pd: pd[0].depth)
            dropped = self.kv.groups[g].index.drop(p.node)
            self.dropped_blocks += len(dropped)
            below = [f"{n.block_hash:x}" for n in dropped[1:]]
            listed = f" ({', '.join(below[:8])}{', ...' if len(below) > 8 else ''})" \
                if below else ""
            logger.warning(
                "KV audit: cached block %d (hash %x; block %d of the prefix hit by request %s, "
                "KV group %d) differs from its recomputation: largest difference %.3g, mean "
                "%.3g of its magnitude (tolerance %g, %g; %d of the hit's blocks differ). "
                "Dropped from the prefix cache with the %d blocks below it%s", p.cached,
                p.node.block_hash, p.depth, job.request_id, g, max_diff, mean_diff, max_tol,
                mean_tol, sum(q.group == g for q, _ in bad), len(below), listed)
