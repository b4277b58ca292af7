"""A request's state: its tokens and a few counters over them.

Everything else (how many tokens are left to compute, whether the next step samples, how many
blocks the request needs) is derived from `token_ids` and `num_computed_tokens`, so there is no
second copy that could drift.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


from kvserve.kv.bounded import BoundedKV
from kvserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone raised inside a step (see LLMEngine.step)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    prompt: str | None = None
    index: int = 0  # which of the n samples of its parent this is
    parent_id: str | None = None
    cache_salt: str | None = None  # requests with different salts never share KV blocks
    priority: int = 0  # higher keeps its cached prefix longer under the "priority" policy
    # Whose cached blocks this request's are, for tenant quotas (kv/seq.py's tenant_of): the
    # server's API-key tenant; None: the cache salt.
    tenant: str | None = None

    # A bounded KV cache (kvserve.kv.bounded; lossy, opt-in), or None: the full cache.
    bounded_kv: BoundedKV | None = None

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Tokens a bounded cache dropped: the KV holds num_computed_tokens - this many (compacted
    # into the first slots), while positions go on at their true values.
    num_dropped_tokens: int = 0
    # Whether a step has sent the worker this request's sampling state (worker/step.py's
    # SeqSampling, sent once; a step's `finished` list lets the worker drop it).
    worker_has_state: bool = False
    # Attention votes ([layers, kv_heads, KV length], one tensor) of a bounded cache that selects
    # by attention: SnapKV's observation window (summed over the prefill chunks that hold it;
    # used, then dropped, after the prompt), H2O's accumulated attention of every query.
    kv_votes: Any | None = None
    stop_reason: int | str | None = None
    # The cache report (kvserve.kv.report.CacheReport), made at admission when asked for.
    cache_report: Any = None
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # vLLM's prompt_logprobs, one entry per prompt token computed so far (entry 0 is None: no
    # distribution predicts the first token); empty unless this request records them.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # The rank of each prompt token in the distribution that predicted it (1 = most likely;
    # vLLM's Logprob.rank), beside `prompt_logprobs`.
    prompt_logprob_ranks: list[int | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    # Structured outputs: this sample's matcher (kvserve.structured.grammar.GrammarState), which
    # advances with every token it keeps, preemption included (the tokens stay), else None.
    grammar: Any = None
    # Speculative decoding (kvserve/spec/): the tokens drafted for this step (not in
    # token_ids: nothing unverified is), the drafted and accepted totals, and the
    # speculator's per-request state (spec/speculator.py's SpecState).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_state: Any = None
    # Document reuse (kvserve/blend/): the [start, end) token spans marked as documents; no
    # block from `publish_limit` on enters the prefix index (blended KV is not exact); the
    # runs of positions the admission step computes; (reused, recomputed, computed) tokens;
    # steps waited for the documents' KV.
    documents: tuple[tuple[int, int], ...] = ()
    publish_limit: int | None = None
    blend_runs: tuple[tuple[int, int], ...] | None = None
    blend_choose: tuple[tuple[int, int, int], ...] | None = None
    blend_counts: tuple[int, int, int] | None = None
    blend_waits: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.records_prompt_logprobs:
            self.prompt_logprobs = [None]
            self.prompt_logprob_ranks = [None]

    @property
    def records_prompt_logprobs(self) -> bool:
        """Whether this sample computes its prompt's logprobs: only the first of n samples
        does (they share the prompt, and the output reports them once)."""
        return self.sampling_params.prompt_logprobs is not None and self.index == 0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request still recording prompt logprobs needs the logits of every prompt position,
        so it computes its whole prompt (`kvserve.kv.manager.matchable_tokens` honours this);
        once they are all recorded (a preempted request resuming), it may hit the cache.

        A bounded cache that selects by attention (SnapKV, H2O) needs every prompt query's
        weights, which a cached block does not hold either: such a request computes its whole
        prompt (it still publishes the prompt's blocks, which hold exact KV)."""
        if self.bounded_kv is not None and self.bounded_kv.selects_by_attention:
            return True
        return self.records_prompt_logprobs and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def skip_reason(self) -> str | None:
        """Why this request reads nothing from the cache (the cache report's reason), if so."""
        if not self.skip_reading_prefix_cache:
            return None
        if self.bounded_kv is not None and self.bounded_kv.selects_by_attention:
            return "bounded"
        return "prompt_logprobs"

    @property
    def prefill_only(self) -> bool:
        """max_tokens 0: computing the prompt is the whole request; nothing is sampled."""
        return self.max_tokens == 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished
