"""The worker's sampling: one step's logits into tokens, logprobs and prompt logprobs.

Why in the worker: the logits are a [rows, vocab] float32 tensor (4 MB for 32 rows of a 32k
vocabulary) and the tokens are a few ints; a worker in another process (a tensor-parallel rank,
a disaggregated decode instance) should send back the ints. So the worker keeps, per request,
what sampling needs (worker/step.py's `SeqSampling`, sent once) and appends the tokens it
samples to it; the scheduler's side keeps the grammars and sends only their bitmask rows.

Failures stay per request: should the batched sampling raise, the rows are sampled one by one,
and only a request whose own row raises fails (vLLM isolates the same way at the request level).
"""

from __future__ import annotations

import logging

import torch

from kvserve.worker.step import SeqSampling, StepInput, StepOutput
from kvserve.sampler import Sampler, SamplingRow
from kvserve.worker.spec_verify import sample_with_drafts

logger = logging.getLogger("kvserve")


class StepSampler:
    def __init__(self, seed: int = 0) -> None:
        self.sampler = Sampler(seed=seed)
        self.requests: dict[str, SeqSampling] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def begin(self, step: StepInput) -> None:
        """Forget the requests that ended; keep the new ones' sampling state."""
        for request_id in step.finished:
            self.requests.pop(request_id, None)
        for seq in step.seqs:
            state = seq.sampling
            if state is not None:
                if state.seed is not None and state.generator is None:
                    state.generator = torch.Generator().manual_seed(state.seed % 2**64)
                self.requests[seq.request_id] = state

    def sample(self, step: StepInput, out: StepOutput) -> None:
        """Fill `out`'s tokens, logprobs and prompt logprobs from its logits."""
        failed = out.failed
        self._prompt_logprobs(step, out, failed)
        if not out.sampled:
            return
        if any(step.seqs[i].num_draft for i in out.sampled):  # speculative decoding
            sample_with_drafts(self.sampler, self.requests, step, out)
            return
        ids = [step.seqs[i].request_id for i in out.sampled]
        rows = [self._row(request_id, step.bitmask_rows.get(i))
                for request_id, i in zip(ids, out.sampled)]
        try:
            result = self.sampler(out.logits, rows, step.bitmask)
            tokens, logprobs = result.token_ids, result.logprobs
        except Exception:
            logger.exception("batched sampling failed; sampling row by row to isolate it")
            tokens, logprobs = self._one_by_one(out.logits, rows, ids, step.bitmask, failed)
        for request_id, token in zip(ids, tokens):
            if token is not None:
                self.requests[request_id].output_token_ids.append(token)
        out.tokens, out.logprobs = tokens, logprobs

    def _row(self, request_id: str, bitmask_row: int | None) -> SamplingRow:
        s = self.requests[request_id]
        return SamplingRow(s.params, s.output_token_ids, s.prompt_token_ids, s.generator,
                           s.eos_token_ids, bitmask_row)

    def _one_by_one(self, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str],
                    bitmask: torch.Tensor | None, failed: dict[str, Exception]
                    ) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """The retry may draw again from generators the failed batch already advanced: greedy
        neighbours are unaffected, random ones stay valid samples."""
        tokens: list[int | None] = []
        logprobs: list[dict[int, float] | None] = []
        for i, (row, request_id) in enumerate(zip(rows, ids)):
            try:
                mask = None
                if row.bitmask_row is not None:
                    mask = bitmask[row.bitmask_row:row.bitmask_row + 1]
                    row = SamplingRow(row.params, row.output_token_ids, row.prompt_token_ids,
                                      row.generator, row.eos_token_ids, 0)
                one = self.sampler(logits[i:i + 1], [row], mask)
                tokens.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            except Exception as exc:
                tokens.append(None)
                logprobs.append(None)
                failed[request_id] = exc
        return tokens, logprobs

    def _prompt_logprobs(self, step: StepInput, out: StepOutput,
                         failed: dict[str, Exception]) -> None:
        """Each span's prompt-token logprobs and ranks, span by span, so that one that raises
        fails its request alone (its entry is empty)."""
        at = 0
        for span in out.prompt_spans:
            request_id = step.seqs[span.index].request_id
            logits = out.prompt_logits[at:at + span.count]
            at += span.count
            try:
                s = self.requests[request_id]
                tokens = s.prompt_token_ids[span.first_token:span.first_token + span.count]
                out.prompt_logprobs.append(self.sampler.token_logprobs(
                    logits, tokens, [s.params.prompt_logprobs] * span.count))
            except Exception as exc:
                out.prompt_logprobs.append(([], []))
                failed[request_id] = exc
