"""Turns a scheduled batch into one forward pass over a flat token batch.

The runner is the only piece that reads both the scheduler's view (requests, new-token counts)
and the cache's (block tables); it translates them into the flat tensors of `AttentionMetadata`
and returns logits only for the rows that sample this step (the last token of each request whose
uncomputed tokens are all scheduled, unless it is prefill-only), so that a prefill chunk never
pays for the LM head — except for a request that records prompt logprobs: every prompt position
of its chunk whose logprobs are not recorded yet gets logits too (`PromptSpan`), in the same
LM-head call.

It is also the one place where KV memory is moved: the batch's step plan (saves to the storage
tiers, loads from them, copy-on-write copies) runs here (`apply_plan`), in that order, before the
forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.engine.scheduler import ScheduledBatch
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.plan import StepPlan
from kvserve.kv.tensors import KVTensorPool
from kvserve.model.attention.base import AttentionBackend, AttentionMetadata, SequenceSlice
from kvserve.model.decoder import CausalLM
from kvserve.request import Request

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class PromptSpan:
    """`count` consecutive rows of `RunnerOutput.prompt_logits` that belong to
    `batch.requests[batch_index]`: row j is the distribution that predicts its prompt token
    `first_token + j` (computed at position `first_token + j - 1`)."""

    batch_index: int
    first_token: int
    count: int


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [len(sampled), vocab] float32, the rows that sample
    sampled: list[int]  # index into batch.requests of each row of `logits`
    # Rows for prompt logprobs ([sum of span counts, vocab] float32), span after span.
    prompt_logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    prompt_spans: list[PromptSpan] = field(default_factory=list)


def prompt_span(request: Request, batch_index: int, start: int, end: int) -> PromptSpan | None:
    """The prompt tokens whose logprobs computing positions [start, end) of `request` yields
    and that it has not recorded yet (a request recomputing its prompt after a preemption
    recorded them the first time), or None.

    Position p predicts token p + 1, so the last prompt position (which samples) yields no
    prompt logprob, and neither does any output position."""
    if not request.records_prompt_logprobs:
        return None
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(end, len(request.prompt_token_ids) - 1)
    return PromptSpan(batch_index, first + 1, last - first) if last > first else None


class ModelRunner:
    def __init__(self, model: CausalLM, backend: AttentionBackend, kv: KVCacheManager,
                 tensors: KVTensorPool) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        self.tensors = tensors
        self.device = model.embed_tokens.device
        # Set by the engine on CUDA (kvserve.engine.cuda_graphs); replays decode-only batches.
        self.graphs = None

    @torch.inference_mode()
    def apply_plan(self, plan: StepPlan) -> None:
        """Saves, then loads, then copies (kv/plan.py says why this order).

        A save is best-effort (a chunk that is not saved is recomputed later), so one that fails
        is logged and the rest of the plan still runs. A load that fails leaves blocks the prefix
        index names without their KV: the prefix cache is dropped before the error goes on, so
        no later request can hit them."""
        for save in plan.saves:
            try:
                self.kv.tiers.save(save.chunk_hash, self.tensors.read_blocks(list(save.blocks)))
            except Exception:
                logger.exception("saving chunk %x to the tiers failed; it is skipped",
                                 save.chunk_hash)
        for load in plan.loads:
            try:
                self.tensors.write_blocks(list(load.blocks), load.data)
            except Exception:
                self.kv.reset_prefix_cache()
                raise
        if plan.copies:
            self.backend.copy_blocks([s for s, _ in plan.copies], [d for _, d in plan.copies])

    def _group_metadata(self, batch: ScheduledBatch, meta: AttentionMetadata
                        ) -> AttentionMetadata:
        """Per-group tables (a hybrid layout): group 0's metadata is `meta` as built from group
        0's tables; every other group gets the same slices over its own tables and slots."""
        bs = self.kv.block_size
        tables = [self.kv.group_block_tables(r) for r in batch.requests]
        slices = sorted(meta.prefills + meta.decodes, key=lambda s: s.start)
        metas = [meta]
        for g in range(1, self.kv.num_groups):
            slots: list[int] = []
            by_start: dict[int, SequenceSlice] = {}
            for seq, request_tables in zip(slices, tables):
                table = request_tables[g]
                kv_start = seq.seq_len - seq.query_len
                slots.extend(table[p // bs] * bs + p % bs for p in range(kv_start, seq.seq_len))
                by_start[seq.start] = SequenceSlice(seq.start, seq.query_len, seq.seq_len, table)
            metas.append(AttentionMetadata(
                torch.tensor(slots, dtype=torch.long),
                [by_start[s.start] for s in meta.prefills],
                [by_start[s.start] for s in meta.decodes], meta.num_prefill_tokens))
        meta.groups = metas
        return meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run the batch (its plan applied already); return the logits of the rows that sample
        and of the prompt positions whose logprobs are wanted."""
        if not batch.requests:
            return RunnerOutput(torch.empty(0), [])
        self.tensors.release_unused(self.kv.pool.ref_counts)  # int4: rows of freed blocks
        bs = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[SequenceSlice] = []
        decodes: list[SequenceSlice] = []
        sample_rows: list[int] = []  # flat token index of each sampled row
        sampled: list[int] = []  # index into batch.requests
        prompt_rows: list[int] = []  # flat token index of each prompt-logprob row
        spans: list[PromptSpan] = []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            end = start + n
            table = self.kv.block_table(request)
            flat_start = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))  # true positions, bounded cache or not
            # KV indices: a bounded cache (kvserve.kv.bounded) compacted its dropped tokens away.
            kv_start = start - request.num_dropped_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(kv_start, kv_start + n))
            seq = SequenceSlice(flat_start, n, kv_start + n, table)
            bound = request.bounded_kv
            if bound is not None and bound.policy == "h2o":  # every query votes
                seq.observe_start, seq.observe_len, seq.key = 0, n, request.request_id
            elif bound is not None and bound.policy == "snapkv" and n > 1:
                # SnapKV's observation window: the prompt's last positions in this chunk.
                prompt_len = len(request.prompt_token_ids)
                first = max(start, prompt_len - bound.observation_window)
                if min(end, prompt_len) > first:
                    seq.observe_start, seq.observe_len = first - start, min(end, prompt_len) - first
                    seq.key = request.request_id
            (prefills if n > 1 else decodes).append(seq)
            if end == request.num_tokens and not request.prefill_only:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(i)
            span = prompt_span(request, i, start, end)
            if span is not None:
                spans.append(span)
                first_row = flat_start + span.first_token - 1 - start
                prompt_rows.extend(range(first_row, first_row + span.count))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=prefills,
            decodes=decodes,
            num_prefill_tokens=sum(s.query_len for s in prefills),
        )
        if self.kv.num_groups > 1:
            meta = self._group_metadata(batch, meta)
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        if self.graphs is not None and not prefills and self.graphs.can_run(len(decodes)):
            hidden = self.graphs.run(ids, pos_t, meta)
        else:
            if self.device.type != "cpu":
                ids = ids.to(self.device, non_blocking=True)
                pos_t = pos_t.to(self.device, non_blocking=True)
            hidden = self.model(ids, pos_t, self.backend.bind(meta))
        rows = sample_rows + prompt_rows
        if not rows:
            return RunnerOutput(torch.empty(0), [])
        if prompt_rows or len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        if not prompt_rows:
            return RunnerOutput(logits, sampled)
        n = len(sample_rows)
        return RunnerOutput(logits[:n], sampled, logits[n:], spans)
