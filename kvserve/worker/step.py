"""One engine step as messages: what the scheduler sends the worker, and what comes back.

Why plain data: a step that is a self-contained description can cross a process boundary. The
worker (runner, model, attention backend, KV tensors) never sees a request, the scheduler or
the KV manager; it gets token ids, positions, block tables and a memory plan, and returns
logits, the chunks it read for the storage tiers and the attention it observed. That is the
seam tensor parallelism (one message to every rank), swap preemption and prefill/decode
disaggregation build on; vLLM v1 draws the same line (SchedulerOutput -> ModelRunnerOutput).

The block tables are the KV manager's own lists, not copies (copying every table of 256
running requests each step costs more than the rest of the message): the scheduler changes
none of them until the step's output is back. An executor that sends the message to another
process serializes them there.

The worker also samples: what it needs of a request to sample it (`SeqSampling`: parameters,
prompt and output tokens for penalties, its seed's generator) is sent once, with the first step
that schedules the request, and kept there until a step's `finished` names it; each step then
carries only the structured-output bitmask of the rows that have a grammar (the matchers stay
on the scheduler's side, which checks each token against them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kv.plan import StepPlan
from kvserve.sampling import SamplingParams


@dataclass(frozen=True)
class PromptSpan:
    """`count` consecutive rows of `StepOutput.prompt_logits` that belong to `seqs[index]`:
    row j is the distribution that predicts its prompt token `first_token + j` (computed at
    position `first_token + j - 1`)."""

    index: int
    first_token: int
    count: int


@dataclass(slots=True)
class SeqSampling:
    """What the worker keeps of a request to sample it, from its first step until it finishes
    (a preempted request keeps it: its generator goes on where it was)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the worker appends each token it samples (penalties)
    eos_token_ids: frozenset[int]
    seed: int | None  # the request's own generator's seed (None: the worker's shared one)
    generator: torch.Generator | None = None  # made by the worker from `seed`


@dataclass(slots=True)
class SeqStep:
    """One request's part of a step. (Not frozen: a frozen dataclass's __init__ costs twice as
    much, and 256 of these are built every step.)"""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0] (true positions, whatever a bounded cache dropped)
    kv_start: int  # where token_ids[0]'s KV goes in the sequence's blocks (start - dropped)
    block_tables: tuple[list[int], ...]  # one per KV group (one unless the model is hybrid)
    samples: bool  # the last row's logits are returned (the request samples a token)
    # Prompt positions whose logits are returned too (prompt logprobs): (first token, count).
    prompt_rows: tuple[int, int] | None = None
    # Rows [start, start + len) whose attention weights are summed and returned (SnapKV's
    # observation window, every row for H2O), or None.
    observe: tuple[int, int] | None = None
    # Set in the first step that schedules the request (the worker keeps it), else None.
    sampling: SeqSampling | None = None
    # Speculative decoding: the last `num_draft` of token_ids are drafted, not yet verified;
    # each of them, and the token before them, gets a logits row (worker/spec_verify.py).
    num_draft: int = 0
    # Document reuse (kvserve/blend/): the token_ids are these runs of positions, each
    # (first position, length), one after another; None: one run from `start`.
    runs: tuple[tuple[int, int], ...] | None = None
    # ... and with selection "deviation": the placed spans (first position, end, rows to keep)
    # whose rows leave the forward after layer `check_layer` but for the most deviating ones.
    choose: tuple[tuple[int, int, int], ...] | None = None
    check_layer: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepInput:
    """Sequences with more than one new token (prefill chunks) first, then decodes; `plan` is
    the KV memory work to do before the forward (kv/plan.py). A step with no sequences only
    runs its plan (write-through saves after a forward, bounded-cache compactions)."""

    seqs: list[SeqStep] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)
    # Requests that ended since the last step: the worker drops what it kept of them.
    finished: list[str] = field(default_factory=list)
    # Structured outputs: one packed int32 row per sampling sequence with a grammar
    # (kvserve.structured.bitmask.apply_bitmask), and seqs index -> its row.
    bitmask: torch.Tensor | None = None
    bitmask_rows: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class StepOutput:
    """The forward's rows (`logits`, `prompt_logits`), then what the worker's sampler made of
    them: a token per sampling row, and each prompt span's logprobs. A row whose sampling
    raised has token None and its error in `failed` (by request id): it alone fails."""

    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(sampled), vocab]
    sampled: list[int] = field(default_factory=list)  # index into seqs of each row of `logits`
    # Rows for prompt logprobs ([sum of span counts, vocab] float32), span after span.
    prompt_logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    # The plan's saves that were read: (chunk hash, its KV), for the storage tiers.
    saved: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # The plan's swap-outs as read: by request id, its blocks' KV (for host swap space).
    swapped: dict[str, torch.Tensor] = field(default_factory=dict)
    # Attention weights observed (SnapKV, H2O): by request id, one [kv_heads, keys] per layer.
    observed: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    tokens: list[int | None] = field(default_factory=list)  # one per `sampled`
    # Speculative decoding: by seqs index, the drafted tokens the verification kept before
    # `tokens`' one, and their logprobs (worker/spec_verify.py); empty without drafts.
    accepted: dict[int, tuple[list[int], list]] = field(default_factory=dict)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # one per `sampled`
    # One per prompt span: (logprob entries, ranks) of its prompt tokens.
    prompt_logprobs: list[tuple[list, list]] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)


class StepFailed(RuntimeError):
    """A step failed after its plan's saves were read (`saved`: the tiers should still get
    them); what failed is the __cause__. `stage` "load": a load of the plan, so blocks the
    prefix index names lack their KV (the scheduler's side drops its prefix cache); "forward":
    the plan landed whole, the forward did not."""

    def __init__(self, stage: str, saved: list[tuple[int, torch.Tensor]],
                 swapped: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(f"the step failed in its {stage}")
        self.stage = stage
        self.saved = saved
        self.swapped = swapped or {}  # the plan's swap-outs as read (they hold, too)
