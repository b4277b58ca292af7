"""`speculative_config`: vLLM's argument, the same JSON shape, checked once at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}

Why a dataclass apart from EngineConfig: the keys depend on the method, and an unknown key must
be refused by name (a misspelt `prompt_lookup_max` silently ignored would be a slow engine
nobody can explain). `disable_by_batch_size` is vLLM's idea too: speculation costs compute that
a large batch already uses well, so from that many running requests on no request drafts.

"draft_model" drafts with a second, smaller model of the same tokenizer (vLLM's shape:
`{"method": "draft_model", "model": PATH_OR_GGUF, "num_speculative_tokens": 4}`, with
`quantization` and `max_model_len` for the draft); spec/draft_model.py runs it. Its path is
checked here, at start-up, before the target model loads: a typo fails in a second, not after
the target's minutes of loading.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvserve.utils.quant_formats import QUANTIZATIONS
from kvserve.utils.validation import json_object

METHODS = ("ngram", "suffix", "draft_model")
BUILT = METHODS
# draft_model's default disable_by_batch_size: drafting costs k draft forwards per request and
# step, run request by request, so its cost grows with the batch while the target's step grows
# far less (docs/figures/spec-decode.md, the draft_model run: SmolLM2 drafting for itself fell
# from 0.68x at 2 requests to 0.24x at 8). A conservative limit, not a measured crossing (no smaller draft of
# SmolLM2's tokenizer was at hand); the step timer stops drafting that does not pay below it.
DRAFT_MODEL_BATCH_LIMIT = 4
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
    # draft_model only: the draft checkpoint (a directory or a GGUF file), its quantization
    # (load_model's; None: the file's default) and the longest sequence it drafts for (None:
    # its max_position_embeddings, capped by the engine's max_model_len)
    model: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.method == "draft_model":
            self._check_draft()
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


    def _check_draft(self) -> None:
        """The draft's own keys; the default batch limit (see DRAFT_MODEL_BATCH_LIMIT)."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config method 'draft_model' needs \"model\": the "
                             "draft checkpoint's directory or GGUF file")
        if not Path(self.model).exists():
            raise ValueError(f"speculative_config draft model {self.model!r} does not exist")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"speculative_config quantization must be one of {QUANTIZATIONS} "
                             f"(or null), got {self.quantization!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", DRAFT_MODEL_BATCH_LIMIT)


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
