"""The worker: runs one step message (worker/step.py) over the model and the KV tensors.

It is handed plain data only: token ids, positions, block tables and a memory plan; it never
sees a request, the scheduler or the KV manager (tests/test_architecture.py holds it to that),
so the same worker can sit behind another process's executor. It turns the step into the
flat tensors of `AttentionMetadata`, computes logits only for the rows that sample (so a
prefill chunk never pays for the LM head) and the prompt positions whose logprobs are wanted,
in the same LM-head call, and samples them (worker/step_sampler.py): what comes back is tokens
and logprobs.

It is also the one place where KV memory is moved: the step's plan (saves read out for the
storage tiers and swap-outs for host swap space, loads from them, copy-on-write copies,
document placements, bounded-cache compactions, per-block state of released blocks dropped)
runs here, in that order, before the forward.
"""

from __future__ import annotations

import logging

import torch

from kvserve.worker.step import PromptSpan, SeqStep, StepFailed, StepInput, StepOutput
from kvserve.worker.placement import place_tokens
from kvserve.worker.row_select import row_selection
from kvserve.worker.step_sampler import StepSampler
from kvserve.kv.plan import StepPlan
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.base import AttentionBackend, AttentionMetadata, SequenceSlice
from kvserve.models.decoder import CausalLM

logger = logging.getLogger("kvserve")


class ModelRunner:
    samples = True  # False on a tensor-parallel rank other than 0: rank 0 alone samples

    def __init__(self, model: CausalLM, backend: AttentionBackend, tensors: KVTensorPool,
                 block_size: int, seed: int = 0) -> None:
        self.model = model
        self.backend = backend
        self.tensors = tensors
        self.block_size = block_size
        self.device = model.device
        # Set by the engine on CUDA (kvserve.worker.cuda_graphs); replays decode-only batches.
        self.graphs = None
        self.sampling = StepSampler(seed)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """The step's plan, then its forward, then its sampling: a token for each row that
        samples, the logprobs of the prompt positions that want them."""
        if self.samples:
            self.sampling.begin(step)
        swapped = self.read_swap_outs(step.plan)
        try:
            saved = self.apply_plan(step.plan)
        except StepFailed as failed:
            failed.swapped = swapped
            raise
        if not step.seqs:
            return StepOutput(saved=saved, swapped=swapped)
        try:
            out = self.forward(step.seqs)
        except Exception as e:
            raise StepFailed("forward", saved, swapped) from e
        out.saved, out.swapped = saved, swapped
        if self.samples:
            self.sampling.sample(step, out)
        return out

    @torch.inference_mode()
    def compare_kv_blocks(self, pairs: list[tuple[int, int]]) -> list[tuple[float, float]]:
        """For each (recomputed, cached) pair of block ids, how far apart their KV is: the
        largest and the mean difference relative to the recomputed block's magnitude (a KV
        audit's measurement, kv/tensors.py's `block_differences`; the engine judges it)."""
        return self.tensors.block_differences(pairs)

    def read_swap_outs(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The KV of each swapped-out request's blocks (kv/swap.py), read with the saves: before
        anything in the step can reuse the blocks. One that fails is logged and left out (that
        request recomputes)."""
        swapped = {}
        for out in plan.swap_outs:
            try:
                swapped[out.request_id] = self.tensors.read_blocks(list(out.blocks))
            except Exception:
                logger.exception("reading request %s's blocks for swap space failed; it will "
                                 "recompute", out.request_id)
        return swapped

    def apply_plan(self, plan: StepPlan) -> list[tuple[int, torch.Tensor]]:
        """Saves, then loads, then copies, then compactions (kv/plan.py says why this order),
        then the released blocks' state; returns the saves' chunks as read.

        A save is best-effort (a chunk that is not saved is recomputed later), so one that fails
        is logged and the rest of the plan still runs. A load that fails raises StepFailed
        (with the chunks read so far)."""
        saved = []
        for save in plan.saves:
            try:
                saved.append((save.chunk_hash, self.tensors.read_blocks(list(save.blocks))))
            except Exception:
                logger.exception("reading chunk %x for the tiers failed; it is skipped",
                                 save.chunk_hash)
        for load in plan.loads:
            try:
                self.tensors.write_blocks(list(load.blocks), load.data)
            except Exception as e:
                raise StepFailed("load", saved) from e
        if plan.copies:
            self.backend.copy_blocks([s for s, _ in plan.copies], [d for _, d in plan.copies])
        if plan.placements:  # after the copies: one may fill a block a placement writes into
            model = self.model
            tables = [model.rope_cos_sin] if model.rope_cos_sin_local is None \
                else [model.rope_cos_sin, model.rope_cos_sin_local]
            place_tokens(self.tensors, tables, model.rope_of_layer, plan.placements)
        for move in plan.compactions:
            self.tensors.compact_tokens(move.src_table, move.keep, move.dst_table)
        if plan.released:  # last: a copy above may still read a released block's state
            self.tensors.release(plan.released)  # int4: residual rows of freed blocks
        return saved

    def _group_metadata(self, seqs: list[SeqStep], meta: AttentionMetadata
                        ) -> AttentionMetadata:
        """Per-group tables (a hybrid layout): group 0's metadata is `meta` as built from group
        0's tables; every other group gets the same slices over its own tables and slots.
        `seqs`: the sequence of each slice in flat order (a verification has several)."""
        bs = self.block_size
        slices = sorted(meta.prefills + meta.decodes, key=lambda s: s.start)
        metas = [meta]
        for g in range(1, len(seqs[0].block_tables)):
            slots: list[int] = []
            by_start: dict[int, SequenceSlice] = {}
            for sl, seq in zip(slices, seqs):
                table = seq.block_tables[g]
                kv_start = sl.seq_len - sl.query_len
                slots.extend(table[p // bs] * bs + p % bs for p in range(kv_start, sl.seq_len))
                by_start[sl.start] = SequenceSlice(sl.start, sl.query_len, sl.seq_len, table)
            metas.append(AttentionMetadata(
                torch.tensor(slots, dtype=torch.long),
                [by_start[s.start] for s in meta.prefills],
                [by_start[s.start] for s in meta.decodes], meta.num_prefill_tokens))
        meta.groups = metas
        return meta

    def _runs(self, seq: SeqStep, flat_start: int, positions: list[int], slots: list[int],
              prefills: list[SequenceSlice]) -> None:
        """A blended request's runs as one prefill slice over its table whose rows carry
        their positions: each row attends to every stored position up to its own, the rows of
        the other runs included (the backend stores every prefill row's K/V before any row
        reads), in one gather and one attention call per layer."""
        bs, table = self.block_size, seq.block_tables[0]
        mine = [p for first, length in seq.runs for p in range(first, first + length)]
        positions.extend(mine)
        slots.extend(table[p // bs] * bs + p % bs for p in mine)
        sl = SequenceSlice(flat_start, len(mine), mine[-1] + 1, table)
        sl.positions = torch.tensor(mine, dtype=torch.long)
        prefills.append(sl)

    def forward(self, seqs: list[SeqStep]) -> StepOutput:
        """The forward over the step's sequences (its plan applied already)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[SequenceSlice] = []
        decodes: list[SequenceSlice] = []
        sample_rows: list[int] = []  # flat token index of each sampled row
        sampled: list[int] = []  # index into seqs
        prompt_rows: list[int] = []  # flat token index of each prompt-logprob row
        spans: list[PromptSpan] = []
        owners: list[int] = []  # the index into seqs of each slice, in flat order
        drafted = 0  # sampled rows that verify a draft
        choosing: list = []  # blended slices whose rows are chosen mid-forward (row_select.py)
        for i, seq in enumerate(seqs):
            n, start, kv_start = seq.num_tokens, seq.start, seq.kv_start
            table = seq.block_tables[0]
            flat_start = len(input_ids)
            input_ids.extend(seq.token_ids)
            if seq.runs is not None:  # a blended request: one slice of rows at positions
                self._runs(seq, flat_start, positions, slots, prefills)
                owners.append(i)
                if seq.choose is not None:
                    choosing.append((prefills[-1], seq.choose, seq.check_layer))
            elif seq.num_draft:  # a verification: one decode row per token (see _draft_rows)
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(kv_start, kv_start + n))
                decodes.extend(_draft_rows(flat_start, n, kv_start, table))
                owners.extend([i] * n)
            else:
                positions.extend(range(start, start + n))  # true positions, bounded or not
                # KV indices: a bounded cache (kvserve.kv.bounded) compacted dropped tokens.
                slots.extend(table[p // bs] * bs + p % bs for p in range(kv_start, kv_start + n))
                sl = SequenceSlice(flat_start, n, kv_start + n, table)
                if seq.observe is not None:
                    sl.observe_start, sl.observe_len = seq.observe
                    sl.key = seq.request_id
                (prefills if n > 1 else decodes).append(sl)
                owners.append(i)
            if seq.samples:  # a drafting sequence: its drafts' rows and the one before them
                last = len(input_ids) - 1
                sample_rows.extend(range(last - seq.num_draft, last + 1))
                sampled.extend([i] * (seq.num_draft + 1))
                drafted += seq.num_draft
            if seq.prompt_rows is not None:
                first_token, count = seq.prompt_rows
                spans.append(PromptSpan(i, first_token, count))
                first_row = flat_start + first_token - 1 - start
                prompt_rows.extend(range(first_row, first_row + count))
        if prefills and decodes and decodes[0].start < prefills[-1].start:
            raise ValueError("a step's decode rows must follow its prefill chunks "
                             "(AttentionMetadata's layout)")
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=prefills,
            decodes=decodes,
            num_prefill_tokens=sum(s.query_len for s in prefills),
        )
        if len(seqs[0].block_tables) > 1:
            meta = self._group_metadata([seqs[i] for i in owners], meta)
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        if self.graphs is not None and not prefills and self.graphs.can_run(len(decodes)):
            hidden = self.graphs.run(ids, pos_t, meta)
        else:
            if self.device.type != "cpu":
                ids = ids.to(self.device, non_blocking=True)
                pos_t = pos_t.to(self.device, non_blocking=True)
            select = row_selection(self.backend, meta, choosing, len(input_ids)) \
                if choosing else None
            if select is None:
                hidden = self.model(ids, pos_t, self.backend.bind(meta))
            else:
                hidden = self.model(ids, pos_t, self.backend.bind(meta), select)
                sample_rows, prompt_rows = select.remap(sample_rows), select.remap(prompt_rows)
        observed = self.backend.observed
        rows = sample_rows + prompt_rows
        if not rows:
            return StepOutput(observed=observed)
        if prompt_rows or len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        # the head's kernel: a verification's rows count once (CausalLM.compute_logits)
        logits = self.model.compute_logits(hidden, len(rows) - drafted) if drafted \
            else self.model.compute_logits(hidden)
        n = len(sample_rows)
        if not prompt_rows:
            return StepOutput(logits, sampled, observed=observed)
        return StepOutput(logits[:n], sampled, logits[n:], spans, observed=observed)


def _draft_rows(flat_start: int, n: int, kv_start: int, table: list[int]
                ) -> list[SequenceSlice]:
    """A verification's n tokens (the last verified one, then the drafts) as n decode rows of
    one block table: row j at KV position kv_start + j attends to kv_start + j + 1 tokens,
    its own and the rows' before it included. Why decode rows and not one n-token prefill
    chunk: each row then runs the very kernels a one-token decode step runs (the one-call
    decode, the paged kernel, the GEMV), so its logits are the bits decoding one token at a
    time computes (greedy with speculation equals greedy without, near ties included), and a
    verification costs about one decode step instead of a prefill's multi-row path. Every
    backend stores all the step's K/V before any row reads (the paged kernel included)."""
    return [SequenceSlice(flat_start + j, 1, kv_start + j + 1, table) for j in range(n)]
