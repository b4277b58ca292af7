"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int
    # Speculative decoding: tokens drafted for the request and of those, kept (0 without it).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Set when this request failed inside a step (its finish_reason is "error"); the other
    # requests of that step went on.
    error: str | None = None
    # vLLM's prompt_logprobs when SamplingParams.prompt_logprobs was set: one entry per prompt
    # token, None for the first, else {token id: logprob} of the actual token and the top-k of
    # the distribution that predicted it (the shape of CompletionOutput.logprobs' entries).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside prompt_logprobs: each prompt token's rank in the distribution that predicted it
    # (1 = most likely, ties share the better rank; None for the first token).
    prompt_logprob_ranks: list[int | None] | None = None
    # With SamplingParams.kv_cache_report: cached tokens by source and why the first uncached
    # prompt token missed (kvserve/kv/report.py's CacheReport.to_dict); else None.
    kv_cache_report: dict | None = None
    # A producer's answer to a `do_remote_decode` request (kv/tiers/transfer.py): what a
    # consumer needs to pull this prompt's KV (vLLM's RequestOutput.kv_transfer_params).
    kv_transfer_params: dict | None = None
