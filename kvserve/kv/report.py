"""The per-request cache report: where a prompt's cached tokens came from, and why the first
token that was not served from the cache missed ("why did my prompt miss?").

The decision is made once, at admission, by the scheduler (or read-only, by `explain`), and
only for a request that asked (`SamplingParams.kv_cache_report`): nothing here runs for other
requests, and nothing runs per step. It reads the manager's state as admission finds it: the
final `PrefixMatch`, the prefix index (read-only walks), the record of recent evictions, and
the storage tiers' record of failed loads.

The reasons, checked in this order at the first missed position:

* `prompt_logprobs` / `bounded`: the request reads nothing from the cache (it needs every
  prompt position's logits, or every prompt query's attention weights for a bounded cache
  that selects by attention);
* `last_token`: everything but the last prompt token was served (it is always computed);
* `window`: the index holds the path further, but the blocks a hit there needs were dropped
  outside a sliding window;
* `tier_error`: the chunk holding the missed block failed to load from a storage tier;
* `evicted`: the missed block was cached and evicted (how long ago, by which policy, pool
  usage then);
* `partial_block`: the prompt's rest is shorter than a block, which the cache never holds;
* `diverged`: the nearest cached prefix continues otherwise: the position where the prompt
  leaves it, with a little of both sides;
* `salt`: the same tokens are cached under another cache_salt (which one, and its text, stay
  unsaid);
* `never_seen`: none of the above.

A report about the requester's own tokens only (`full=False`: what the server gives callers
who are not its admin, kvserve/server/auth.py) holds counts, positions and reasons about the
tokens the requester sent, and nothing else of what the cache holds: no `cached_text`, no
`diverged` where the cached continuation shares none of the requester's next tokens (that
would say another prompt goes on there), and no `salt` (an exact oracle for "somebody else
sent this", which a salt exists to close): such positions read as a prompt never seen would.
Its positions say no more than `cached_tokens` does: a partial hit serves the shared tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.evicted import EvictionRecord  # noqa: F401 (the index fills it)
from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.kv.prefix_index import Node, PrefixIndex, PrefixMatch, common_prefix
from kvserve.kv.seq import CachedSeq, matchable_tokens

REASONS = ("never_seen", "evicted", "diverged", "salt", "partial_block", "window",
           "prompt_logprobs", "tier_error", "bounded", "last_token")
# Output names of the hit sources (the hit counters call Redis "remote").
SOURCE_NAMES = {"device": "device", "host": "host", "disk": "disk", "remote": "redis"}
CONTEXT_TOKENS = 8  # tokens shown on each side of a divergence
MAX_SALTS_SEARCHED = 64  # other tenants' roots looked at for `salt` (each costs a few hashes)


@dataclass
class CacheReport:
    prompt_tokens: int
    cached_tokens: int
    by_source: dict[str, int]
    reason: str | None  # None: every prompt token was served (cannot happen: last_token)
    first_miss: int | None  # the first prompt position not served from the cache
    missed_tokens: int
    detail: dict[str, Any] = field(default_factory=dict)
    # token ids that `to_dict` turns into text (a divergence's two sides)
    texts: dict[str, list[int]] = field(default_factory=dict)
    # Document reuse (kvserve/blend/): reused, recomputed and computed tokens of its spans
    documents: dict[str, int] | None = None

    def to_dict(self, decode=None) -> dict[str, Any]:
        detail = dict(self.detail)
        for key, ids in self.texts.items():
            detail[key] = decode(ids) if decode is not None else ids
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "cached_tokens_by_source": dict(self.by_source),
                "first_miss": None if self.reason is None else
                {"position": self.first_miss, "reason": self.reason, **detail},
                "missed_tokens": self.missed_tokens,
                **({} if self.documents is None else {"documents": dict(self.documents)})}


def _by_source(kv, match: PrefixMatch) -> dict[str, int]:
    out = dict.fromkeys(SOURCE_NAMES.values(), 0)
    out["device"] = len(match.nodes) * kv.block_size + match.partial_len
    if getattr(match, "chunks", None):
        for source, tokens in kv.tiers.tokens_by_source(match):
            out[SOURCE_NAMES.get(source, source)] += tokens
    return out


def build_report(kv, seq: CachedSeq, match: PrefixMatch, skip_reason: str | None = None,
                 full: bool = True) -> CacheReport:
    """The report of a sequence admitted with `match` (read-only: changes nothing).
    `skip_reason`: why the sequence reads nothing from the cache, if it does not; `full`:
    False for a report about the sequence's own tokens only (the module docstring)."""
    total = len(seq.token_ids)
    hit = match.num_tokens
    report = CacheReport(total, hit, _by_source(kv, match), None, None, total - hit)
    if skip_reason is not None:
        report.reason, report.first_miss = skip_reason, 0
        return report
    limit = matchable_tokens(seq)
    if hit >= limit:
        report.reason, report.first_miss = "last_token", hit
        return report
    report.first_miss = hit
    if not kv.prefix_caching:
        report.reason, report.detail = "never_seen", {"prefix_caching": False}
        return report
    report.reason = _reason(kv, seq, match, limit, report, others=full)
    return report


def _reason(kv, seq: CachedSeq, match: PrefixMatch, limit: int, report: CacheReport,
            others: bool) -> str:
    """`others`: whether the reason may speak of what the cache holds beyond the sequence's
    tokens (a full report)."""
    bs = kv.block_size
    j = match.num_full_blocks  # the first block not served whole
    tokens = seq.token_ids
    extra = extra_keys(seq.cache_salt)
    index: PrefixIndex = kv.groups[0].index
    full = limit // bs
    hashes = kv.block_hashes(seq, full) if full else []
    if j < full:
        # window: the path goes on in the index, but a hit there lacks blocks it needs
        walked = max(len(g.index.walk(tokens[:limit], hashes, extra)) for g in kv.groups)
        if walked > j:
            report.detail = {"window": kv.groups[0].window
                             if kv.num_groups == 1 else [g.window for g in kv.groups],
                             "cached_path_tokens": walked * bs}
            return "window"
        h = hashes[j]
        failed = _tier_error(kv, hashes, j)
        if failed is not None:
            report.detail = failed
            return "tier_error"
        gone = index.evictions.get(h) if index.evictions is not None else None
        if gone is not None:
            when, policy, usage = gone
            report.detail = {"evicted_seconds_ago": round(max(0.0, time.time() - when), 3),
                             "policy": policy, "pool_usage_at_eviction": round(usage, 4)}
            return "evicted"
    # the nearest cached continuation of the matched prefix
    node = match.nodes[-1] if match.nodes else index._roots.get(extra)
    start = j * bs
    rest = tokens[start:min(start + bs, limit)]
    best, shared = _nearest_child(node, rest)
    if j >= full and best is None:
        report.detail = {"block_size": bs, "tail_tokens": limit - start}
        return "partial_block"
    if best is not None and (shared > 0 or (j > 0 and others)):
        at = start + shared
        report.first_miss = at
        report.detail = {"diverged_at": at}
        report.texts = {"text_before": list(tokens[max(0, at - CONTEXT_TOKENS):at]),
                        "prompt_text": list(tokens[at:at + CONTEXT_TOKENS])}
        if others:
            report.texts["cached_text"] = list(best.tokens[shared:shared + CONTEXT_TOKENS])
        return "diverged"
    if others and j < full and _cached_under_other_salt(kv, index, seq, j + 1, extra):
        report.detail = {"cached_under_other_salt": True}
        return "salt"
    if j >= full:
        report.detail = {"block_size": bs, "tail_tokens": limit - start}
        return "partial_block"
    return "never_seen"


def _nearest_child(node: Node | None, rest) -> tuple[Node | None, int]:
    """The cached child of `node` sharing the most leading tokens with `rest` (any child if
    none shares one), and how many it shares."""
    if node is None or not rest:
        return None, 0
    best, shared = None, 0
    for child in node.by_first_token.get(rest[0], ()):
        n = common_prefix(child.tokens, rest)
        if n > shared:
            best, shared = child, n
    if best is None and node.children:
        best = next(reversed(node.children.values()))  # the latest continuation
    return best, shared


def _tier_error(kv, hashes: list[int], j: int) -> dict[str, Any] | None:
    tiers = kv.tiers
    cb = getattr(tiers, "chunk_blocks", 0)
    if not cb:
        return None
    last = (j // cb + 1) * cb - 1
    if last >= len(hashes):
        return None
    failed = tiers.tiers.load_error(hashes[last])
    if failed is None:
        return None
    tier, kind = failed
    return {"tier": SOURCE_NAMES.get(tier, tier), "error": kind}


def _cached_under_other_salt(kv, index: PrefixIndex, seq: CachedSeq, depth: int,
                             extra: bytes) -> bool:
    """Whether another extra-key namespace holds the sequence's first `depth` blocks (hashes
    chained under each other root's extra keys: a few hashes per tenant, for reported requests
    only)."""
    bs = kv.block_size
    tokens = seq.token_ids[:depth * bs]
    for other in index.root_keys()[:MAX_SALTS_SEARCHED]:
        if other == extra:
            continue
        hashes = chain_hashes(tokens, bs, other)
        if len(index.walk(tokens, hashes, other)) >= depth:
            return True
    return False
