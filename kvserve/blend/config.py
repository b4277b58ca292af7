"""`blend_config`: document reuse (CacheBlend) switched on, checked once at start-up.

    {"recompute_fraction": 0.15, "selection": "deviation", "check_layer": 1,
     "anchor": "prefix", "audit_rate": 0.0, "audit_threshold": 0.5}

Why a JSON object of its own, as `speculative_config`: the keys belong together, and an
unknown key is refused by name rather than silently ignored.

* `recompute_fraction`: the share of each reused span's tokens whose KV is recomputed in the
  request's own context (the paper's ~15%; 0 reuses the stored KV as it is).
* `selection`: how those tokens are chosen. "deviation" (the default, the paper's): every
  token of the step runs through the first layers, and after layer `check_layer` each span
  keeps the tokens whose fresh K/V differ most from the stored; "first": each span's first
  tokens, chosen before the forward (cheaper; measured worse, docs/benchmarks.md).
* `check_layer` (LMCache's `blend_check_layers`, one layer): the layer whose K/V deviation
  chooses (0 would see none: a token's first-layer K/V do not depend on its context).
* `anchor`: what a document is computed behind. "prefix" (the default): the request's own
  text before its first document (in RAG, the shared system prompt), so a stored document has
  seen the instructions every request puts before it and lacks only the other documents;
  "separator": a fixed short separator (CacheBlend's position-independent chunk), reusable
  behind any prefix. On SmolLM2's RAG workload "prefix" moved the log-likelihood of the exact
  answers 2.7% against 6.5% (docs/benchmarks.md); a document is then stored once per prefix.
* `audit_rate`: the fraction of blended requests whose first token's distribution is also
  computed without blending and compared (kvserve/blend/audit.py); 0 turns audits off.
* `audit_threshold`: the audited divergence (KL of the blended next-token distribution from
  the exact one, nats, averaged over the audits so far) past which blending turns itself off.
* `min_audits`: audits needed before the threshold can turn blending off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.validation import json_object


@dataclass(frozen=True)
class BlendConfig:
    recompute_fraction: float = 0.15
    selection: str = "deviation"
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
        if self.selection not in ("deviation", "first"):
            raise ValueError("blend_config selection must be 'deviation' or 'first', "
                             f"got {self.selection!r}")
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) \
                or self.check_layer < 1:
            raise ValueError("blend_config check_layer must be an integer >= 1 (layer 0's "
                             f"K/V do not depend on the context), got {self.check_layer!r}")
        if self.anchor not in ("prefix", "separator"):
            raise ValueError("blend_config anchor must be 'prefix' or 'separator', "
                             f"got {self.anchor!r}")
        if isinstance(self.audit_threshold, bool) \
                or not isinstance(self.audit_threshold, (int, float)) \
                or self.audit_threshold <= 0:
            raise ValueError("blend_config audit_threshold must be a positive number, "
                             f"got {self.audit_threshold!r}")
        if isinstance(self.min_audits, bool) or not isinstance(self.min_audits, int) \
                or self.min_audits < 1:
            raise ValueError("blend_config min_audits must be a positive integer, "
                             f"got {self.min_audits!r}")


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
