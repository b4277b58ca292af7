"""Steps 0-3 of the sampler's order (kvserve/sampler/sampler.py): logit_bias, grammar
bitmasks, min_tokens masking, repetition, frequency and presence penalties, on a copy of the rows
they change. One function, so that the order the docs promise is the order in the code."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.sampler.rows import SamplingRow, min_tokens_banned
from kvserve.structured.bitmask import apply_bitmask


def _ids(token_ids: Sequence[int], offset: int, vocab: int) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        t = token_ids.reshape(-1).long().cpu()
    else:  # NumPy converts a list of ints about 4x faster than torch.tensor
        t = torch.from_numpy(np.asarray(token_ids, dtype=np.int64).reshape(-1))
    t = t[(t >= 0) & (t < vocab)]  # an id outside the vocabulary must not touch another row
    return t + offset


def apply_logit_changes(work: torch.Tensor, changed: list[tuple[int, SamplingRow]],
                         token_bitmask: torch.Tensor | None = None) -> None:
    """logit_bias, grammar bitmasks, min_tokens masking, repetition, frequency and presence
    penalties, in place on `work` (contiguous); `changed` pairs a row of `work` with its
    SamplingRow, whose `bitmask_row` names a row of `token_bitmask`. Every update goes through
    flat indices row * vocab + token, so the cost follows the number of tokens, not the vocab."""
    vocab = work.shape[1]
    flat = work.view(-1)
    device = work.device

    bias_keys: list[int] = []
    bias_values: list[float] = []
    for j, row in changed:
        for t, b in (row.params.logit_bias or {}).items():
            if 0 <= t < vocab:  # the engine refuses ids outside the vocabulary
                bias_keys.append(j * vocab + t)
                bias_values.append(b)
    if bias_keys:  # keys are distinct: a dict has each token once per row
        keys = torch.tensor(bias_keys, device=device)
        flat[keys] += torch.tensor(bias_values, dtype=work.dtype, device=device)
    masked = [(j, row.bitmask_row) for j, row in changed if row.bitmask_row is not None]
    if masked:
        assert token_bitmask is not None  # check_inputs
        apply_bitmask(work, token_bitmask, masked)

    banned: list[int] = []
    for j, row in changed:  # a grammar decides alone where its output ends
        if len(row.output_token_ids) < row.params.min_tokens and row.bitmask_row is None:
            banned.extend(j * vocab + t for t in min_tokens_banned(row) if 0 <= t < vocab)
    if banned:
        flat[torch.tensor(banned, device=device)] = float("-inf")

    rep = [(j, row) for j, row in changed if row.params.repetition_penalty != 1.0]
    if rep:
        # Repeated keys are harmless: every copy of a key writes the same value.
        keys = torch.cat([_ids(row.prompt_token_ids, j * vocab, vocab) for j, row in rep]
                         + [_ids(row.output_token_ids, j * vocab, vocab) for j, row in rep])
        keys = keys.to(device)
        penalty = torch.ones(work.shape[0], dtype=work.dtype, device=device)
        penalty[torch.tensor([j for j, _ in rep], device=device)] = torch.tensor(
            [row.params.repetition_penalty for _, row in rep], dtype=work.dtype, device=device)
        penalty = penalty[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)

    freq = [(j, row) for j, row in changed
            if (row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0)
            and len(row.output_token_ids)]
    if freq:
        keys, counts = torch.unique(
            torch.cat([_ids(row.output_token_ids, j * vocab, vocab) for j, row in freq]),
            return_counts=True)
        keys, counts = keys.to(device), counts.to(device)
        fp = torch.zeros(work.shape[0], 2, dtype=work.dtype, device=device)
        fp[torch.tensor([j for j, _ in freq], device=device)] = torch.tensor(
            [[row.params.frequency_penalty, row.params.presence_penalty] for _, row in freq],
            dtype=work.dtype, device=device)
        fp = fp[keys // vocab]
        flat[keys] = flat[keys] - (fp[:, 0] * counts.to(work.dtype) + fp[:, 1])
