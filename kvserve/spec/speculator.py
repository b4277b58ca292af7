"""The scheduler's side of speculative decoding: how many tokens a request drafts this step,
the drafts themselves, and the acceptance counters (vLLM's spec_decode_* metrics).

When it pays: a verification computes k + 1 tokens for a request to keep 1 to k + 1 of them.
A request whose drafts keep being rejected pays for nothing, so each request keeps a running
acceptance rate: under `acceptance_floor` it drafts fewer tokens, under a quarter of it it
stops drafting for `_PAUSE_STEPS` steps (then tries again). A large batch already uses the
compute well: from `disable_by_batch_size` running requests on, nobody drafts (vLLM's idea).

And whether a verification pays depends on the machine: on a CPU a k + 1-token verification
can cost several one-token decode steps. So the speculator also times the engine's decode-only
steps (`observe_step`), with and without drafts: once steps with drafts give fewer tokens per
second than steps without, nobody drafts for `_THROTTLE_STEPS` steps, after which it measures
again (the text, and with it the acceptance, changes as requests go on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvserve.request import Request
from kvserve.spec.config import SpeculativeConfig
from kvserve.spec.ngram import ngram_draft

_PAUSE_STEPS = 16  # steps a request with a collapsed acceptance rate drafts nothing
_SMOOTHING = 0.3  # weight of the newest verification in the running acceptance rate
_THROTTLE_STEPS = 64  # decode steps nobody drafts once drafting was measured not to pay
_MIN_SAMPLES = 4  # timed steps of each kind before drafting is judged

# A drafter: (the request, most tokens to draft) -> drafted tokens.
Drafter = Callable[[Request, int], list[int]]


@dataclass
class SpecState:
    """A request's recent acceptance rate and how many more steps it pauses."""

    rate: float = 1.0
    pause: int = 0


@dataclass
class SpecCounters:
    """Cumulative, vLLM's names: verifications with drafts, drafted and accepted tokens, and
    accepted tokens by draft position (position 0: the first drafted token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}


@dataclass
class _StepRates:
    """Tokens per second of decode-only steps, with drafts and without (running means)."""

    rate: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    samples: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    throttled: int = 0  # steps left without drafting

    def add(self, drafted: bool, tokens_per_s: float) -> None:
        n = self.samples[drafted] = self.samples[drafted] + 1
        weight = max(1.0 / n, _SMOOTHING)
        self.rate[drafted] += weight * (tokens_per_s - self.rate[drafted])

    def pays(self) -> bool | None:
        """Whether drafted steps give more tokens per second (None: too few samples)."""
        if min(self.samples.values()) < _MIN_SAMPLES:
            return None
        return self.rate[True] >= 0.95 * self.rate[False]


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None,
                 max_rows: int | None = None) -> None:
        """`drafter`: the method's (n-gram lookup unless given: spec/build.py builds the
        suffix drafter over the prefix index). `max_rows`: the most rows the model's one-call
        decode step runs (None: no such step, no limit); see `draft_rows`."""
        self.config = config
        self.max_rows = max_rows
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.drafter = drafter or self._ngram
        self.steps = _StepRates()
        self.throttled = False  # drafting measured not to pay: only seeded requests draft
        # Seconds the drafter took: this step's (counted into the step's time by
        # `observe_step`: a draft model's forwards run before the step's own) and in all.
        self.step_draft_seconds = 0.0
        self.draft_seconds = 0.0

    def _ngram(self, request: Request, k: int) -> list[int]:
        c = self.config
        return ngram_draft(request.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def active(self, num_running: int) -> bool:
        """Whether anyone drafts in a step with this many running requests (called once a
        step: it also counts the throttle down)."""
        self.throttled = self.steps.throttled > 0
        self.step_draft_seconds = 0.0
        if self.throttled:
            self.steps.throttled -= 1
            if self.steps.throttled == 0:  # measure drafted steps anew
                self.steps.rate[True], self.steps.samples[True] = 0.0, 0
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def draft_rows(self, num_running: int) -> float:
        """How many drafted tokens a step with this many running requests may hold in all:
        the one-call decode step's rows less a row per request. Why: a verification pays and
        is exact because its rows run as one-token decodes do, on that step (gemv.cpp,
        qdecode.cpp); rows beyond it take the layer-by-layer path, whose multi-row kernels
        cost more and round otherwise (a greedy near tie would then go the other way)."""
        if self.max_rows is None:
            return float("inf")
        return max(0, self.max_rows - num_running)

    def observe_step(self, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step (no prefill rows) appended `num_tokens` in `seconds`; with drafts
        or not. Throttles drafting when it is measured not to pay."""
        seconds += self.step_draft_seconds  # (the drafting happened while scheduling)
        if seconds <= 0.0 or num_tokens <= 0:
            return
        steps = self.steps
        steps.add(drafted, num_tokens / seconds)
        if drafted and steps.pays() is False:
            steps.throttled = _THROTTLE_STEPS

    def propose(self, request: Request, room: int) -> list[int]:
        """The drafts for a decoding request, at most `room` (what its budget, max_tokens and
        the context leave); [] while it pauses."""
        state = request.spec_state
        if state is None:
            state = request.spec_state = SpecState()
        if self.throttled and request.sampling_params.seed is None:
            return []  # (a seeded request's drafts must not depend on timing: it goes on)
        if state.pause > 0:
            state.pause -= 1
            return []
        k = min(room, self._width(state))
        if k <= 0:
            return []
        started = time.perf_counter()
        draft = self.drafter(request, k)
        spent = time.perf_counter() - started
        self.step_draft_seconds += spent
        self.draft_seconds += spent
        return draft

    def release(self, request: Request) -> None:
        """A request finished: the drafter drops what it kept of it (a draft model's KV)."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(request)

    def _width(self, state: SpecState) -> int:
        """k, scaled down with the acceptance rate under the floor."""
        k, floor = self.config.num_speculative_tokens, self.config.acceptance_floor
        if state.rate >= floor or floor == 0.0:
            return k
        return max(1, int(k * state.rate / floor))

    def record(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """A verification of `num_draft` drafts kept `num_accepted` of them."""
        if num_draft == 0:
            return
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_draft
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        request.num_draft_tokens += num_draft
        request.num_accepted_tokens += num_accepted
        state = request.spec_state
        state.rate += _SMOOTHING * (num_accepted / num_draft - state.rate)
        if state.rate < self.config.acceptance_floor / 4:
            state.pause = _PAUSE_STEPS
            state.rate = self.config.acceptance_floor  # tried again at the floor's width
