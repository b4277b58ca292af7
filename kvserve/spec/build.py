"""The engine's two hooks into speculation: the speculator its config asks for, and cutting a
request back to the token a stop string ended it on (a verification may have kept tokens
after it, which decoding one token at a time would never have produced)."""

from __future__ import annotations

from typing import Any

from kvserve.request import Request
from kvserve.spec.config import SpeculativeConfig
from kvserve.spec.speculator import Speculator


def build_speculator(config: SpeculativeConfig | None, kv: Any, model: Any = None,
                     drafter: Any = None) -> Speculator | None:
    """None without speculation; `kv` (the KV cache manager) is the suffix drafter's source;
    `model` (in this process; None elsewhere) says how many rows its one-call decode step
    runs (`Speculator.draft_rows`); `drafter`: method draft_model's, loaded with the engine
    (worker/builder.py's load_drafter)."""
    if config is None:
        return None
    step = getattr(model, "decode_step", None)
    max_rows = getattr(step, "max_rows", None)
    if config.method == "suffix":
        from kvserve.spec.suffix import SuffixDrafter

        return Speculator(config, SuffixDrafter(kv, config), max_rows)
    if config.method == "draft_model":
        if drafter is None:
            raise ValueError("speculative_config method 'draft_model': no draft model loaded")
        return Speculator(config, drafter, max_rows)
    return Speculator(config, max_rows=max_rows)


def drop_tokens(request: Request, count: int) -> None:
    """Remove the request's last `count` output tokens (with their logprobs)."""
    if count <= 0:
        return
    gone = request.token_ids[-count:]
    del request.token_ids[-count:]
    if request.output_logprobs:
        for token, logprobs in zip(gone, request.output_logprobs[-count:]):
            request.cumulative_logprob -= logprobs[token]
        del request.output_logprobs[-count:]
