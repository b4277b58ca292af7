"""The step as the worker gets it: one `SeqStep` per scheduled request, and the grammar
bitmask rows.

Why apart from the scheduler: choosing which requests run (engine/scheduler.py) and writing
down what the worker needs of them are two jobs; this one only *reads* requests and the KV
manager's block tables (it never drives the manager), and it is the one place that does so for
the step message (worker/step.py).
"""

from __future__ import annotations

import torch

from kvserve.engine.bounded_kv import BoundedCaches
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.structured.grammar import bitmask_words
from kvserve.worker.step import SeqSampling, SeqStep, StepInput


def prompt_rows(request: Request, start: int, end: int) -> tuple[int, int] | None:
    """The prompt tokens whose logprobs computing positions [start, end) of `request` yields
    and that it has not recorded yet (a request recomputing its prompt after a preemption
    recorded them the first time), as (first token, count), or None.

    Position p predicts token p + 1, so the last prompt position (which samples) yields no
    prompt logprob, and neither does any output position."""
    if not request.records_prompt_logprobs:
        return None
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(end, len(request.prompt_token_ids) - 1)
    return (first + 1, last - first) if last > first else None


def seq_steps(kv: KVCacheManager, bounded: BoundedCaches,
              chosen: list[tuple[Request, int]]) -> list[SeqStep]:
    """The worker's view of each request's part of the step (for every running request,
    every step)."""
    one_group = kv.num_groups == 1
    table_of = kv.block_table
    observe_rows = bounded.observe_rows
    seqs = []
    append = seqs.append
    for request, n in chosen:
        start = request.num_computed_tokens
        end = start + n
        token_ids = request.token_ids
        draft = request.draft_token_ids
        if draft:  # n counts them: they follow the one uncomputed token
            end -= len(draft)
            token_ids = token_ids + draft
        tables = (table_of(request),) if one_group \
            else tuple(kv.group_block_tables(request))
        # The common case (no prompt logprobs, no bounded cache) calls nothing.
        rows = None if request.sampling_params.prompt_logprobs is None \
            else prompt_rows(request, start, end)
        observe = None if request.bounded_kv is None else observe_rows(request, start, end)
        append(SeqStep(
            request.request_id, token_ids[start:start + n], start,
            start - request.num_dropped_tokens, tables,
            end == request.num_tokens and request.max_tokens != 0, rows, observe,
            None if request.worker_has_state else _sampling_state(request), len(draft)))
    return seqs


def grammar_bitmask(requests: list[Request], step: StepInput, vocab_size: int,
                    failed: dict[str, Exception]) -> None:
    """The allowed next tokens of each sampling row with a grammar (`requests[i]` is
    `step.seqs[i]`), one packed row each in `step.bitmask` (the matchers stay with the
    scheduler: the worker applies the bits). A matcher that raises fails its request alone,
    after the step (its row allows everything; its parent id goes into `failed`)."""
    rows = {i: j for j, i in enumerate(
        i for i, (r, s) in enumerate(zip(requests, step.seqs))
        if s.samples and r.grammar is not None)}
    if not rows:
        return
    step.bitmask = bitmask = torch.full((len(rows), bitmask_words(vocab_size)), -1,
                                        dtype=torch.int32)
    step.bitmask_rows = rows
    for i, j in rows.items():
        request = requests[i]
        try:
            request.grammar.fill_bitmask(bitmask, j)
        except Exception as exc:
            bitmask[j] = -1
            failed[request.parent_id or request.request_id] = exc


def _sampling_state(request: Request) -> SeqSampling:
    """What the worker keeps of a request to sample it (sent once; see SeqSampling)."""
    request.worker_has_state = True
    params = request.sampling_params
    seed = None if params.seed is None else params.seed + request.index
    return SeqSampling(params, request.prompt_token_ids, list(request.output_token_ids),
                       frozenset(request.eos_token_ids), seed)
