"""`kvserve diagnose`, end to end: render the log, find where requests diverge, classify the
spans there, and measure each class's fix by replaying the log with and without it.

The measurement is the point: a class of pollution is ranked by the hit rate its fix would
bring back at this pool size (replay.hit_rate), not by how often it appears; a per-request UUID
at the end of a prompt is everywhere and costs nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from kvserve.diagnose.classify import CLASSES, LABELS, Finding, classify
from kvserve.diagnose.divergence import find_divergences
from kvserve.diagnose.log import LogRecord, RequestLog
from kvserve.diagnose.normalize import FixContext, apply_fixes
from kvserve.diagnose.render import render_all
from kvserve.diagnose.replay import DEFAULT_BLOCK_SIZE, PoolSize, hit_rate, unbounded_pool


@dataclass
class ClassReport:
    """One class of pollution: how many requests diverge there, an example, and the replayed
    hit rate of the log as it is and with this class fixed."""

    cls: str
    label: str
    requests: int  # requests the fix changes
    divergences: int  # requests whose divergence from their nearest earlier one is this class
    example: str
    example_other: str
    hit_rate: float
    hit_rate_fixed: float

    @property
    def gain_points(self) -> float:
        return 100.0 * (self.hit_rate_fixed - self.hit_rate)


@dataclass
class Diagnosis:
    source: str
    requests: int
    prompt_tokens: int
    pool: PoolSize
    hit_rate: float  # replayed
    served_hit_rate: float | None  # what the server reported (kvserve's log)
    classes: list[ClassReport]  # ranked by gain
    hit_rate_all_fixed: float
    divergences: dict[str, int] = field(default_factory=dict)  # every category's count
    overlapped: int = 0  # requests that overlapped an earlier one on the server
    skipped: int = 0  # requests the template could not render (left out of the replay)
    skip_reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, cd in zip(self.classes, d["classes"]):
            cd["gain_points"] = round(c.gain_points, 3)
        return d


def resolve_pool(log: RequestLog, rendered, block_size: int | None,
                 pool_blocks: int | None) -> PoolSize:
    """The pool to replay at: the flags, else the request log's header (the server's own
    pool), else a pool that holds everything; evicting as the server's header says."""
    bs = block_size or log.block_size or DEFAULT_BLOCK_SIZE
    policy = log.meta.get("eviction_policy", "lru")
    if policy not in ("lru", "lfu", "priority"):
        policy = "lru"
    if pool_blocks is not None:
        return PoolSize(bs, pool_blocks, "flags", policy)
    if log.pool_blocks is not None and bs == log.block_size:
        return PoolSize(bs, int(log.pool_blocks), "request log", policy)
    return PoolSize(bs, unbounded_pool(rendered, bs), "unbounded", policy)


def find_spans(records: list[LogRecord], rendered) -> list[Finding]:
    """Every request's divergence from its nearest earlier request, classified."""
    out = []
    for div in find_divergences(rendered):
        other = div.other
        out.append(classify(div, rendered[div.index].text,
                            rendered[other].text if other >= 0 else None,
                            records[div.index], records[other] if other >= 0 else None))
    return out




def renderable(log: RequestLog, tokenizer, memo: dict) -> tuple[RequestLog, int, str]:
    """The log without the requests this model's template cannot render (a log from another
    server may hold content kvserve does not take, such as images), the number dropped and
    the first reason. The resets keep their places among the requests kept."""
    kept, skipped, reason, resets = [], 0, "", []
    pending = sorted(log.resets)
    for i, r in enumerate(log.records):
        while pending and pending[0] <= i:
            pending.pop(0)
            resets.append(len(kept))
        try:
            render_all(tokenizer, [r], memo)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            skipped += 1
            reason = reason or f"request {i}: {str(exc).splitlines()[0]}"
            continue
        kept.append(r)
    if not kept:
        raise ValueError(f"no request of the log renders with this model's template ({reason})")
    return replace(log, records=kept, resets=[x for x in resets if 0 < x < len(kept)]), \
        skipped, reason


def diagnose(log: RequestLog, tokenizer, block_size: int | None = None,
             pool_blocks: int | None = None, progress=None) -> Diagnosis:
    """The ranked report of a request log. `progress`, when given, wraps the list of classes
    being replayed (tqdm)."""
    memo: dict = {}  # renderings shared by the log and its fixed versions
    log, skipped, reason = renderable(log, tokenizer, memo)
    records = log.records
    rendered = render_all(tokenizer, records, memo)
    pool = resolve_pool(log, rendered, block_size, pool_blocks)
    findings = find_spans(records, rendered)
    counts = Counter(f.cls for f in findings)
    base = hit_rate(rendered, pool, log.resets)
    ctx = FixContext.from_findings(findings, records)
    found = [c for c in CLASSES if counts.get(c)]
    reports = []
    for cls in (progress(found) if progress is not None and found else found):
        example = next(f for f in findings if f.cls == cls)
        fixed_rendered = render_all(tokenizer, apply_fixes(records, [cls], ctx), memo)
        fixed = hit_rate(fixed_rendered, pool, log.resets)
        touched = sum(f.token_ids != r.token_ids for f, r in zip(fixed_rendered, rendered))
        reports.append(ClassReport(cls, LABELS[cls], touched, counts[cls], example.span,
                                   example.other_span, base.rate, fixed.rate))
    reports.sort(key=lambda r: (-r.gain_points, -r.requests))
    all_fixed = hit_rate(render_all(tokenizer, apply_fixes(records, found, ctx), memo), pool,
                         log.resets).rate if found else base.rate
    return Diagnosis(log.source, len(records), base.prompt_tokens, pool, base.rate,
                     log.served_hit_rate, reports, all_fixed, dict(counts), log.overlapped,
                     skipped, reason)


def cleaned_records(log: RequestLog, tokenizer, classes: list[str]) -> list[LogRecord]:
    """The log with the fixes of `classes` applied: what a user would serve after fixing them
    (and what the tests serve to check a predicted gain)."""
    rendered = render_all(tokenizer, log.records)
    findings = find_spans(log.records, rendered)
    return apply_fixes(log.records, classes, FixContext.from_findings(findings, log.records))
