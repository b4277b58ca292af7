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

Sampling stays on the engine's side for now: the worker returns the sampling rows' logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kv.plan import StepPlan


@dataclass(frozen=True)
class PromptSpan:
    """`count` consecutive rows of `StepOutput.prompt_logits` that belong to `seqs[index]`:
    row j is the distribution that predicts its prompt token `first_token + j` (computed at
    position `first_token + j - 1`)."""

    index: int
    first_token: int
    count: int


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class StepOutput:
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(sampled), vocab]
    sampled: list[int] = field(default_factory=list)  # index into seqs of each row of `logits`
    # Rows for prompt logprobs ([sum of span counts, vocab] float32), span after span.
    prompt_logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    # The plan's saves that were read: (chunk hash, its KV), for the storage tiers.
    saved: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Attention weights observed (SnapKV, H2O): by request id, one [kv_heads, keys] per layer.
    observed: dict[str, list[torch.Tensor]] = field(default_factory=dict)


class StepFailed(RuntimeError):
    """A step failed after its plan's saves were read (`saved`: the tiers should still get
    them); what failed is the __cause__. `stage` "load": a load of the plan, so blocks the
    prefix index names lack their KV (the scheduler's side drops its prefix cache); "forward":
    the plan landed whole, the forward did not."""

    def __init__(self, stage: str, saved: list[tuple[int, torch.Tensor]]) -> None:
        super().__init__(f"the step failed in its {stage}")
        self.stage = stage
        self.saved = saved
