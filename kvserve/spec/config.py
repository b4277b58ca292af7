"""`speculative_config`: vLLM's argument, the same JSON shape, checked once at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}

Why a dataclass apart from EngineConfig: the keys depend on the method, and an unknown key must
be refused by name (a misspelt `prompt_lookup_max` silently ignored would be a slow engine
nobody can explain). `disable_by_batch_size` is vLLM's idea too: speculation costs compute that
a large batch already uses well, so from that many running requests on no request drafts.

Not built yet: "draft_model" (a second, small model drafting) is named and refused, so the
message says what is missing rather than that the method does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.validation import json_object

METHODS = ("ngram", "suffix", "draft_model")
BUILT = ("ngram", "suffix")
# Keys every method takes, and each method's own.
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size",
           "acceptance_floor"}
_KEYS = {
    "ngram": _COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    "suffix": _COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": _COMMON | {"model", "quantization", "max_model_len"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What speculation does; field names are vLLM's where vLLM has one.

    `acceptance_floor` (kvserve's): a request whose recent acceptance rate (accepted / drafted)
    falls under it drafts fewer tokens, and stops drafting for a while at a quarter of it, so a
    request whose text does not repeat costs nothing."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    acceptance_floor: float = 0.3
    model: str | None = None  # draft_model only (refused for now)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.method not in BUILT:
            raise ValueError(f"speculative_config method {self.method!r} is not supported yet "
                             f"(kvserve drafts from the KV cache: {BUILT})")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if not 0.0 <= self.acceptance_floor < 1.0:
            raise ValueError("speculative_config acceptance_floor must be in [0, 1), "
                             f"got {self.acceptance_floor!r}")


def load_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or a JSON string (the CLI's) -> the config; unknown
    keys, a key of another method or a bad value raise ValueError naming it."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object(value, "speculative_config")
    method = value.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown} for method "
                         f"{method!r}; known: {sorted(_KEYS[method])}")
    known = {f.name for f in fields(SpeculativeConfig)}
    return SpeculativeConfig(**{k: v for k, v in value.items() if k in known})


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
