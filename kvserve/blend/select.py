"""Which positions a blended request computes: every token outside the reused documents (the
text between them and the question after them) and a share of each document's tokens, chosen
one of two ways (blend_config `selection`).

"first" (the default, kvserve's rule): each document's first tokens, chosen before the forward,
so the step computes only them and the text outside documents. The earlier a token sits in its
document, the larger the share of its attention the unseen context (the text before the
document) takes, and the first tokens carry the attention-sink role that only the real first
token should have.

"deviation" (CacheBlend's, Yao et al., EuroSys 2025): the step runs every position through the
first layers; after layer `check_layer` the worker (kvserve/worker/row_select.py) compares each
placed token's fresh K/V with the stored ones and keeps, per document, the tokens that deviate
most; the other rows leave the forward there and keep their stored K/V in the later layers.

Measured on SmolLM2-135M's RAG workload (docs/figures/doc-reuse.md, "Answers identical to full
recompute"): at 15% and 30% "first" kept as many greedy answers identical (45% / 55% against 50% /
40%) and the exact answers' log-likelihood closer (+3.1% / +2.1% against +3.7% / +3.7%) while
computing fewer rows; neither reaches what choosing by the true final deviation reaches (an
oracle: 50% / 58%), so layer 1's deviation is a poor predictor of it on this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Span = tuple[int, int]


@dataclass(frozen=True)
class BlendPlan:
    """A blended request's step: positions [start, end) are made ready, `placed` from stored
    documents (each (first position, end, the document's own start)), `runs` computed (in the
    first layers, with "deviation"), `choose` the placed spans whose rows after the check layer
    are chosen by deviation, each (first position, end, how many to keep); () with "first"."""

    start: int
    end: int
    placed: tuple[tuple[int, int, int], ...]
    runs: tuple[Span, ...]
    reused: int  # placed tokens kept as stored
    recomputed: int  # placed tokens recomputed
    computed: int  # tokens outside any document, computed
    choose: tuple[tuple[int, int, int], ...] = ()

    @property
    def cost(self) -> int:
        """Rows the forward starts with (what the step's budget pays: its activations)."""
        return sum(b - a for a, b in self.runs)


def plan_blend(start: int, end: int, documents: tuple[Span, ...], fraction: float,
               selection: str = "first") -> BlendPlan | None:
    """The plan for positions [start, end) (start: what the prefix cache already holds), or
    None when no document lies there (nothing to place). The last position is always
    computed (its logits sample), and no run is a single token where a neighbour can join
    it (a one-row slice would be a decode row, stored after the prefill rows read)."""
    placed = [(max(a, start), min(b, end), a) for a, b in documents
              if b > start and a < end and max(a, start) < min(b, end)]
    if placed and placed[-1][1] == end:  # the last position samples: computed
        a, b, origin = placed.pop()
        if b - 1 > a:
            placed.append((a, b - 1, origin))
    if not placed:
        return None
    if selection == "deviation":
        choose = tuple((a, b, _recomputed(b - a, fraction)) for a, b, _ in placed)
        kept = sum(n for _, _, n in choose)
        total = sum(b - a for a, b, _ in placed)
        return BlendPlan(start, end, tuple(placed), ((start, end),), total - kept, kept,
                         end - start - total, choose)
    keep = [(a + _recomputed(b - a, fraction), b) for a, b, _ in placed]
    keep = [(a, b) for a, b in keep if a < b]
    runs = _gaps(start, end, keep)
    runs = _no_single_rows(runs, keep, start, end)
    computed_total = sum(b - a for a, b in runs)
    inside = sum(_overlap(run, (a, b)) for run in runs for a, b, _ in placed)
    total_placed = sum(b - a for a, b, _ in placed)
    return BlendPlan(start, end, tuple(placed), tuple(runs), total_placed - inside, inside,
                     computed_total - inside)


def _recomputed(n: int, fraction: float) -> int:
    return min(n, math.ceil(n * fraction)) if fraction > 0 else 0


def _gaps(start: int, end: int, kept: list[Span]) -> list[Span]:
    """[start, end) without the kept spans (sorted, disjoint), as runs."""
    runs, at = [], start
    for a, b in kept:
        if a > at:
            runs.append((at, a))
        at = max(at, b)
    if at < end:
        runs.append((at, end))
    return runs


def _no_single_rows(runs: list[Span], kept: list[Span], start: int, end: int) -> list[Span]:
    """Widen each one-token run by a neighbouring kept token (it is then recomputed too),
    backwards where possible, and merge runs that come to touch."""
    if len(runs) == 1 and runs[0][1] - runs[0][0] == 1 and end - start == 1:
        return runs
    widened = []
    for a, b in runs:
        if b - a == 1:
            if a > start:
                a -= 1
            elif b < end:
                b += 1
        widened.append((a, b))
    merged: list[Span] = []
    for a, b in widened:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _overlap(x: Span, y: Span) -> int:
    return max(0, min(x[1], y[1]) - max(x[0], y[0]))
