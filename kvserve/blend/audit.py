"""Blending's quality gate (`blend_config` audit_rate, audit_threshold): a sampled share of
blended requests is also computed without blending, and their next-token distributions are
compared.

Why: blending trades exactness for time, and how much it gives up depends on the model (small
models, whose attention spreads over the whole context, lose more: docs/figures/doc-reuse.md has
the figures) and on the workload. Measured on the served traffic, not assumed: when the mean
divergence passes the threshold after `min_audits` audits, blending turns itself off (logged;
requests are then computed exactly), as the hit audits (engine/audit.py) drop a bad block.

How: at a sampled request's admission two internal twins of its prompt are queued behind the
waiting requests, each max_tokens 1 with the top `TOP_K` logprobs: one blended as the request
was, one exact under a salt of its own (it reads no document and no blended block, and what it
publishes no other request can read). They return no output; once both have sampled, the
divergence is KL(exact || blended) over the exact distribution's top tokens, both renormalised
over them (a token missing from the blended top-k is given the blended k-th logprob, an upper
bound on its probability).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

from kvserve.request import Request
from kvserve.sampling import SamplingParams

logger = logging.getLogger("kvserve")

TWIN_ID_PREFIX = "kvserve-blend-audit-"
TOP_K = 20
_TWIN = SamplingParams(max_tokens=1, temperature=0, logprobs=TOP_K, ignore_eos=True)


@dataclass(eq=False)
class AuditTwin(Request):
    """An internal copy of a sampled blended request's prompt: `blended` or exact."""

    job: int = 0
    blended: bool = False


@dataclass
class AuditState:
    audits: int = 0
    divergences: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.divergences) / len(self.divergences) if self.divergences else 0.0


def kl_top(exact: dict[int, float], blended: dict[int, float]) -> float:
    """KL(exact || blended) in nats over the exact top-k tokens, both distributions
    renormalised over them (so the estimate is a true KL, >= 0; see the module docstring)."""
    floor = min(blended.values())
    tokens = list(exact)
    e = _normalised([exact[t] for t in tokens])
    b = _normalised([blended.get(t, floor) for t in tokens])
    return max(0.0, sum(math.exp(x) * (x - y) for x, y in zip(e, b)))


def _normalised(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    total = top + math.log(sum(math.exp(x - top) for x in logprobs))
    return [x - total for x in logprobs]


class BlendAuditor:
    def __init__(self, rate: float, threshold: float, min_audits: int, seed: int = 0) -> None:
        self.rate = rate
        self.threshold = threshold
        self.min_audits = min_audits
        self.rng = random.Random(seed)
        self.state = AuditState()
        self.spawned: list[AuditTwin] = []
        self._open: dict[int, dict[bool, dict[int, float]]] = {}
        self._next = 0

    def sample(self, request: Request) -> None:
        """A blended request was admitted: maybe queue its two twins."""
        if isinstance(request, AuditTwin) or self.rng.random() >= self.rate:
            return
        job = self._next
        self._next += 1
        self._open[job] = {}
        prompt = list(request.prompt_token_ids)
        for blended in (True, False):
            salt = request.cache_salt if blended else f"{request.cache_salt}\0blend-audit"
            self.spawned.append(AuditTwin(
                f"{TWIN_ID_PREFIX}{job}-{int(blended)}", prompt, _TWIN, max_tokens=1,
                eos_token_ids=request.eos_token_ids, cache_salt=salt,
                documents=request.documents if blended else (), job=job, blended=blended))

    def take_spawned(self) -> list[AuditTwin]:
        spawned, self.spawned = self.spawned, []
        return spawned

    def observe(self, twin: AuditTwin, logprobs: dict[int, float] | None) -> bool | None:
        """A twin sampled; once both have, the divergence is recorded. Returns False when
        this audit turns blending off, else None."""
        sides = self._open.get(twin.job)
        if sides is None or not logprobs:
            return None
        sides[twin.blended] = logprobs
        if len(sides) < 2:
            return None
        del self._open[twin.job]
        divergence = kl_top(sides[False], sides[True])
        state = self.state
        state.audits += 1
        state.divergences.append(divergence)
        if state.audits >= self.min_audits and state.mean > self.threshold:
            logger.warning("document reuse turned off: blended requests' next-token "
                           "distributions diverge from exact ones by %.3g nats on average over "
                           "%d audits (blend_config audit_threshold %g)", state.mean,
                           state.audits, self.threshold)
            return False
        return None

    def forget(self, twin: AuditTwin) -> None:
        """A twin that ended without sampling (aborted, failed): its audit is dropped."""
        self._open.pop(twin.job, None)
