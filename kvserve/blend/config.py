"""`blend_config`: document reuse (CacheBlend) switched on, checked once at start-up.

    {"recompute_fraction": 0.15, "selection": "first", "check_layer": 1,
     "anchor": "prefix", "audit_rate": 0.0, "audit_threshold": 0.5}

Why a JSON object of its own, as `speculative_config`: the keys belong together, and an
unknown key is refused by name rather than silently ignored.

* `recompute_fraction`: the share of each reused span's tokens whose KV is recomputed in the
  request's own context (the paper's ~15%; 0 reuses the stored KV as it is).
* `selection`: how those tokens are chosen. "first" (the default): each span's first tokens,
  chosen before the forward; "deviation" (the paper's): every token of the step runs through
  the first layers, and after layer `check_layer` each span keeps the tokens whose fresh K/V
  differ most from the stored. On SmolLM2's RAG workload "first" kept as many answers
  identical or more, and the exact answers' log-likelihood closer, at a lower cost
  (docs/figures/doc-reuse.md); kvserve/blend/select.py says why.
* `check_layer` (LMCache's `blend_check_layers`, one layer): the layer whose K/V deviation
  chooses (0 would see none: a token's first-layer K/V do not depend on its context).
* `anchor`: what a document is computed behind. "prefix" (the default): the request's own
  text before its first document (in RAG, the shared system prompt), so a stored document has
  seen the instructions every request puts before it and lacks only the other documents;
  "separator": a fixed short separator (CacheBlend's position-independent chunk), reusable
  behind any prefix. On SmolLM2's RAG workload "prefix" moved the log-likelihood of the exact
  answers 2.7% against 6.5% (docs/doc_reuse.md); a document is then stored once per prefix.
* `audit_rate`: the fraction of blended requests whose first token's distribution is also
  computed without blending and compared (kvserve/blend/audit.py); 0 turns audits off.
* `audit_threshold`: the audited divergence (KL of the blended next-token distribution from
  the exact one, nats, averaged over the audits so far) past which blending turns itself off.
* `min_audits`: audits needed before the threshold can turn blending off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.utils.validation import json_object


@dataclass(frozen=True)
class BlendConfig:
    recompute_fraction: float = 0.15
    selection: str = "first"
    check_layer: int = 1
    anchor: str = "prefix"
    audit_rate: float = 0.0
    audit_threshold: float = 0.5
    min_audits: int = 3

    def __post_init__(self) -> None:
        for name in ("recompute_fraction", "audit_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value <= 1.0:
                raise ValueError(f"blend_config {name} must be a number in [0, 1], "
                                 f"got {value!r}")
        _choice("selection", self.selection, ("deviation", "first"))
        _choice("anchor", self.anchor, ("prefix", "separator"))
        _integer("check_layer", self.check_layer, 1, " (layer 0's K/V do not depend on the "
                 "context)")
        _integer("min_audits", self.min_audits, 1)
        if isinstance(self.audit_threshold, bool) \
                or not isinstance(self.audit_threshold, (int, float)) \
                or self.audit_threshold <= 0:
            raise ValueError("blend_config audit_threshold must be a positive number, "
                             f"got {self.audit_threshold!r}")


def _choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"blend_config {name} must be one of {options}, got {value!r}")


def _integer(name: str, value: Any, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"blend_config {name} must be an integer >= {low}{why}, "
                         f"got {value!r}")


def load_blend_config(value: Any) -> BlendConfig | None:
    """None, a BlendConfig, a dict or a JSON string (the CLI's) -> the config; unknown keys
    or bad values raise ValueError naming them."""
    if value is None or isinstance(value, BlendConfig):
        return value
    value = json_object(value, "blend_config")
    known = {f.name for f in fields(BlendConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"blend_config: unknown key(s) {unknown}; known: {sorted(known)}")
    return BlendConfig(**value)
