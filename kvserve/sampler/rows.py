"""What one step's rows are and need: a row's view of its request (`SamplingRow`), the result
(`SampleResult`), the checks on the sampler's inputs, and the per-step plan of which rows are
greedy, which random and whose logits change. Apart from the arithmetic so that the sampler's
entry point and the logit changes read the same rules (min_tokens' banned ids, the greedy cut)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.sampling import SamplingParams

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature samples greedily


@dataclass
class SamplingRow:
    """One sequence's view for this step. Token id lists may also be 1-D integer tensors or
    arrays (cheaper to convert for long prompts)."""

    params: SamplingParams
    output_token_ids: Sequence[int] = field(default_factory=list)  # generated so far
    prompt_token_ids: Sequence[int] = field(default_factory=list)  # for repetition penalty
    # The request's own generator when params.seed is set (created once per request by the
    # engine: torch.Generator().manual_seed(seed)); None draws from the sampler's generator.
    generator: torch.Generator | None = None
    eos_token_ids: Iterable[int] = field(default_factory=frozenset)  # masked during min_tokens
    # Structured outputs: the row of the step's stacked bitmask (the `token_bitmask` argument
    # of the sampler's call; packed int32, ceil(vocab / 32) words a row, filled by
    # kvserve.structured.grammar) that holds the tokens this row's grammar allows next; None =
    # no grammar. One tensor for the step, not a view per row: the engine fills it in one
    # piece and the sampler applies it in one piece.
    bitmask_row: int | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: None unless params.logprobs is set; else {token id: raw logprob} for the top-N
    # tokens plus the sampled one (N or N + 1 entries; the sampled token is inserted first).
    logprobs: list[dict[int, float] | None]
    # Per row: 1-based rank of the sampled token in the raw distribution (1 = most likely; ties
    # share the better rank), or None when params.logprobs is not set.
    ranks: list[int | None] = field(default_factory=list)


def check_inputs(logits: torch.Tensor, rows: Sequence[SamplingRow],
           token_bitmask: torch.Tensor | None) -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                         f"got {tuple(logits.shape)}")
    named = [r.bitmask_row for r in rows if r.bitmask_row is not None]
    if named:
        if token_bitmask is None or token_bitmask.dim() != 2 \
                or token_bitmask.dtype != torch.int32:
            got = None if token_bitmask is None else (token_bitmask.dtype,
                                                      tuple(token_bitmask.shape))
            raise ValueError("rows name a bitmask row (bitmask_row), so token_bitmask must be "
                             f"an int32 [rows, words] tensor, got {got}")
        if min(named) < 0 or max(named) >= token_bitmask.shape[0]:
            raise ValueError(f"bitmask_row must be in [0, {token_bitmask.shape[0]}), got "
                             f"{min(named) if min(named) < 0 else max(named)}")
    logits = logits.detach()
    return logits if logits.dtype == torch.float32 else logits.float()


class Plan:
    """Which rows need what this step."""

    def __init__(self, rows: Sequence[SamplingRow],
                 token_bitmask: torch.Tensor | None = None) -> None:
        self.token_bitmask = token_bitmask  # the step's grammar bitmasks (bitmask_row)
        self.greedy_plain: list[int] = []
        self.greedy_changed: list[int] = []  # greedy, but its logits change (bias...)
        self.random: list[int] = []
        self.changed: list[bool] = []  # per row: bias, min_tokens or penalties apply
        for i, row in enumerate(rows):
            changes = _needs_logit_changes(row)
            self.changed.append(changes)
            if row.params.temperature >= GREEDY_EPS:
                self.random.append(i)
            elif changes:
                self.greedy_changed.append(i)
            else:
                self.greedy_plain.append(i)


def _needs_logit_changes(row: SamplingRow) -> bool:
    p = row.params
    if p.logit_bias or row.bitmask_row is not None:
        return True
    if len(row.output_token_ids) < p.min_tokens and min_tokens_banned(row):
        return True
    if p.repetition_penalty != 1.0 and (len(row.prompt_token_ids) or len(row.output_token_ids)):
        return True
    penalised = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return penalised and len(row.output_token_ids) > 0


def min_tokens_banned(row: SamplingRow) -> set[int]:
    banned = set(row.params.stop_token_ids or ())
    if not row.params.ignore_eos:
        banned.update(row.eos_token_ids)
    return banned
