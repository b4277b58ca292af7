"""The sampler: turns one step's logits into one token per sequence. This module holds the entry
point, its workspace and the logprobs; the steps live beside it (rows.py: the rows and the plan;
logit_changes.py: steps 0-3; truncation.py: the top-k/top-p cut; draw.py: the draw).

The worker (worker/step_sampler.py) calls `Sampler()(logits, rows)` once per step with the
float32 logits of every sequence that samples in that step and a `SamplingRow` per row.

Order of operations (vLLM's):

0. ``logit_bias``: each listed token's bias is added to its logit (OpenAI's logit_bias).
   Structured outputs: a row with a grammar (``bitmask_row``, its row of the step's one
   stacked bitmask ``token_bitmask``, packed int32 words: bit ``t % 32`` of word ``t // 32``
   allows token t) gets -inf on every token its grammar forbids (structured/bitmask.py: a NumPy
   byte table on the CPU, xgrammar's ``apply_token_bitmask_inplace`` on other devices).
   Only those rows are copied and masked; the others pay nothing.
1. ``min_tokens``: while ``len(output) < min_tokens`` the row's ``stop_token_ids`` and, unless
   ``ignore_eos``, its EOS ids get logit -inf.
2. Repetition penalty over the prompt and output tokens (HF/vLLM: a positive logit is divided by
   the penalty, any other multiplied).
3. Frequency and presence penalties over the output tokens (OpenAI:
   ``logit -= frequency * count + presence * (count > 0)``).
4. Greedy rows (``temperature < 1e-5`` as in vLLM; 0 is the documented value) take the argmax
   (the first one on ties). Random rows: divide by the temperature, then top-k, then top-p (the
   smallest set of most likely tokens whose probability, renormalised after top-k, reaches
   ``top_p``; the most likely token always stays), then min-p (drop tokens whose probability is
   below ``min_p`` times the largest), then draw from what is left. Tokens tied with the top-k or
   top-p cut all stay (transformers keeps top-k ties too; its top-p keeps an arbitrary part of a
   tie).

Returned logprobs are the *raw* ones (vLLM's default ``logprobs_mode="raw_logprobs"``):
``log_softmax`` of the logits exactly as passed in, before min_tokens masking, penalties,
temperature or any filtering.

Cost model (a 2-core CPU, up to 256 rows x 32k vocab):

* An all-greedy batch without penalties is one argmax over the logits (NumPy's, several times
  faster than torch's on CPU) and nothing else.
* The input tensor is never modified. Rows are copied only when logit_bias, min_tokens or
  penalties change them; penalties touch only the listed token positions (flat indices), never a vocab-wide mask.
* Random rows go through a reusable workspace, 65 rows at a time for a 32k vocabulary: fresh
  multi-megabyte tensors each step would cost more in page faults than the arithmetic in them.
* Only rows with top-k/top-p sort anything, and they sort probability *values* with NumPy (about
  15x faster than ``torch.sort`` on CPU): a partition isolates each row's 1024 largest values,
  only those are sorted, and only a row whose cut lies lower (a flat distribution) sorts the
  rest. The cut becomes a per-row threshold applied in vocabulary order.
* The draw is inverse-CDF sampling in two levels (blocks of 256 tokens, then one block), so no
  full-vocabulary cumulative sum is built.

Reproducibility: each random row consumes exactly one uniform number per step, from its own
generator when the request is seeded, so a seeded request yields the same tokens whether it runs
alone or in any batch. Everything else is row-local (softmax, sort, sums over a row).

Precondition: every row keeps at least one finite logit after min_tokens masking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.kernels.cpu import gemv
from kvserve.sampler.draw import draw, uniforms
from kvserve.sampler.logit_changes import apply_logit_changes
from kvserve.sampler.rows import Plan, SampleResult, SamplingRow, check_inputs
from kvserve.sampler.truncation import topk_topp_threshold

_CHUNK_FLOATS = 1 << 21  # random rows go in chunks whose workspace buffers stay within 8 MiB


class Sampler:
    """Not thread-safe: it keeps a reusable workspace between calls."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for rows without their own
        self._workspace: torch.Tensor | None = None  # [2, chunk rows, vocab] float32
        self._copy: np.ndarray | None = None  # rows whose logits change, reused between steps

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 token_bitmask: torch.Tensor | None = None) -> SampleResult:
        """One token per row of `logits` ([len(rows), vocab]; never modified). `token_bitmask`:
        the step's packed grammar bitmasks (int32 [n, words]), read by the rows that name one of
        its rows (`SamplingRow.bitmask_row`)."""
        with torch.inference_mode():
            logits = check_inputs(logits, rows, token_bitmask)
            plan = Plan(rows, token_bitmask)
            if logits.device.type != "cpu" and (
                    len(plan.greedy_plain) < len(rows)
                    or any(r.params.logprobs is not None for r in rows)):
                # GPU logits: plain greedy stays on the device (one argmax, a few bytes back);
                # anything else runs on the host path, which per-request CPU generators
                # and the NumPy top-k/top-p code need, and which is what the tests cover.
                logits = logits.cpu()
            if len(plan.greedy_plain) == len(rows):
                tokens = _argmax(logits)  # the hot path: one argmax, nothing else built
            else:
                tokens = self._sample(logits, rows, plan, want_probs=False)
            token_ids = tokens.tolist()
            if any(r.params.logprobs is not None for r in rows):
                logprobs, ranks = self.token_logprobs(logits, token_ids,
                                                      [r.params.logprobs for r in rows])
            else:
                logprobs, ranks = [None] * len(rows), [None] * len(rows)
        return SampleResult(token_ids, logprobs, ranks)

    def distribution(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                     token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The normalised distribution `__call__` would draw each row from ([len(rows), vocab]
        float32; one-hot at the argmax for greedy rows). The same code path without the draw,
        for tests and debugging; it draws nothing from any generator."""
        with torch.inference_mode():
            logits = check_inputs(logits, rows, token_bitmask)
            return self._sample(logits, rows, Plan(rows, token_bitmask), want_probs=True)

    # -- selection -------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], plan: Plan,
                want_probs: bool) -> torch.Tensor:
        """Token ids [batch], or with `want_probs` the normalised distributions [batch, vocab]."""
        batch, vocab = logits.shape
        device = logits.device
        if want_probs:
            out = torch.zeros_like(logits)
        else:
            out = torch.empty(batch, dtype=torch.long, device=device)

        def put(index: list[int], tokens: torch.Tensor) -> None:
            if want_probs:
                out[index, tokens] = 1.0
            else:
                out[torch.tensor(index, dtype=torch.long, device=device)] = tokens

        if plan.greedy_plain:  # a NumPy argmax of every row is cheaper than gathering rows
            put(plan.greedy_plain, _argmax(logits)[plan.greedy_plain])

        # Rows whose logits change (logit_bias, grammar, min_tokens, penalties) are copied, and
        # only they: the others are read from the logits as they are.
        if any(plan.changed):
            changed = plan.greedy_changed + [i for i in plan.random if plan.changed[i]]
            copy = self._copy_rows(logits, changed)
            apply_logit_changes(copy, [(j, rows[i]) for j, i in enumerate(changed)],
                                 plan.token_bitmask)
            source = {i: (copy, j) for j, i in enumerate(changed)}
            if plan.greedy_changed:
                put(plan.greedy_changed, _argmax(copy[: len(plan.greedy_changed)]))
        else:
            source = {}

        chunk = _chunk_rows(vocab)
        for start in range(0, len(plan.random), chunk):
            index = plan.random[start:start + chunk]
            chunk_rows = [rows[i] for i in index]
            probs = self._probs(chunk_rows, [source.get(i, (logits, i)) for i in index])
            if want_probs:
                out[index] = probs / probs.sum(dim=-1, keepdim=True)
            else:
                put(index, self._draw(probs, chunk_rows))
        return out

    def _copy_rows(self, logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """A contiguous copy of logits[index], on the CPU into a buffer kept between calls
        (a fresh multi-megabyte array each step costs more in page faults than the copy)."""
        if logits.device.type != "cpu":
            return _rows(logits, index)
        n, vocab = len(index), logits.shape[1]
        if self._copy is None or self._copy.shape[0] < n or self._copy.shape[1] != vocab:
            self._copy = np.empty((max(n, 8), vocab), dtype=np.float32)
        out = self._copy[:n]
        np.take(logits.numpy(), index, axis=0, out=out)
        return torch.from_numpy(out)

    def _buffers(self, n: int, vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self._workspace
        chunk = _chunk_rows(vocab)
        if ws is None or ws.shape[1:] != (chunk, vocab) or ws.device != device:
            ws = self._workspace = torch.empty(2, chunk, vocab, device=device)
        return ws[0, :n], ws[1, :n]

    def _probs(self, rows: list[SamplingRow], picks: list[tuple[torch.Tensor, int]]
               ) -> torch.Tensor:
        """softmax(x / T) after top-k, top-p and min-p, in a workspace buffer, where row k of
        x is row picks[k][1] of tensor picks[k][0] (the logits, or the copy of changed rows):
        dropped tokens are exactly 0, the others keep their (not renormalised) probability."""
        source = picks[0][0]
        n, vocab = len(picks), source.shape[1]
        device = source.device
        scratch, probs = self._buffers(n, vocab, device)
        index = [j for _, j in picks]
        if any(t is not source for t, _ in picks):  # rows from both: gather them one by one
            for k, (t, j) in enumerate(picks):
                scratch[k].copy_(t[j])
            x = scratch
        elif index == list(range(index[0], index[0] + n)):
            x = source[index[0]:index[0] + n]
        else:
            x = torch.index_select(source, 0, torch.tensor(index, device=device), out=scratch)
        temps = [r.params.temperature for r in rows]
        if any(t != 1.0 for t in temps):
            x = torch.div(x, torch.tensor(temps, dtype=x.dtype, device=device).unsqueeze(1),
                          out=scratch)
        _softmax_into(x, probs)

        # Per-row threshold: tokens whose probability falls below it are dropped (0 keeps all).
        threshold = torch.zeros(n, dtype=probs.dtype, device=device)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0.0 for m in min_p):  # drop p < min_p * p_max, as transformers' MinP
            threshold = torch.tensor(min_p, dtype=probs.dtype, device=device) * probs.amax(dim=-1)
        sort_rows = [j for j, r in enumerate(rows)
                     if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
        if sort_rows:  # the scratch buffer is free again: sort copies of these rows in it
            ks = [min(rows[j].params.top_k or vocab, vocab) for j in sort_rows]
            ps = [rows[j].params.top_p for j in sort_rows]
            if len(sort_rows) == n:
                cut = topk_topp_threshold(scratch.copy_(probs), ks, ps)
                threshold = torch.maximum(threshold, cut)
            else:
                at = torch.tensor(sort_rows, device=device)
                sortable = torch.index_select(probs, 0, at, out=scratch[: len(sort_rows)])
                threshold[at] = torch.maximum(threshold[at], topk_topp_threshold(sortable, ks, ps))
        if bool((threshold > 0).any()):
            # threshold_(row, t, 0) keeps entries > t; the float32 just below the threshold keeps
            # the ties. A call per row is several times faster on CPU than a broadcast
            # masked_fill.
            below = torch.nextafter(threshold, torch.full_like(threshold, float("-inf")))
            for j, t in enumerate(below.tolist()):
                if t >= 0.0:
                    torch.threshold_(probs[j], t, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return draw(probs, uniforms(rows, self.generator))

    def token_logprobs(self, logits: torch.Tensor, token_ids: Sequence[int],
                       num_top: Sequence[int | None]) -> tuple[list[dict[int, float] | None],
                                                               list[int | None]]:
        """log_softmax of raw float32 logits ([rows, vocab]) for the rows whose `num_top` is
        not None: {token id: logprob} of the row's top-N and of its token in `token_ids`
        (inserted first), and that token's 1-based rank; chunked through the workspace.

        One function for both kinds of logprobs (a prompt token's: worker/step_sampler.py),
        so that they cannot differ. Runs in inference mode, as `__call__` does: the workspace
        it writes into may have been made there; an inference tensor is read-only outside it."""
        with torch.inference_mode():
            return self._token_logprobs(logits, token_ids, num_top)

    def _token_logprobs(self, logits: torch.Tensor, token_ids: Sequence[int],
                        num_top: Sequence[int | None]) -> tuple[list[dict[int, float] | None],
                                                                list[int | None]]:
        batch, vocab = logits.shape
        device = logits.device
        logprobs: list[dict[int, float] | None] = [None] * batch
        ranks: list[int | None] = [None] * batch
        wanted = [i for i, k in enumerate(num_top) if k is not None]
        chunk = _chunk_rows(vocab)
        for start in range(0, len(wanted), chunk):
            index = wanted[start:start + chunk]
            n = len(index)
            scratch, lp = self._buffers(n, vocab, device)
            if index == list(range(index[0], index[0] + n)):
                x = logits[index[0]:index[0] + n]
            else:
                x = torch.index_select(logits, 0, torch.tensor(index, device=device), out=scratch)
            _log_softmax_into(x, lp)
            chosen = torch.tensor([token_ids[i] for i in index], device=device).unsqueeze(1)
            chosen_lp = lp.gather(1, chosen)
            rank_list = ((lp > chosen_lp).sum(dim=1) + 1).tolist()
            chosen_lps = chosen_lp.squeeze(1).tolist()
            n_top = min(max(num_top[i] for i in index), vocab)
            top_ids: list[list[int]] = [[] for _ in index]
            top_lps: list[list[float]] = [[] for _ in index]
            if n_top > 0:
                values, ids = lp.topk(n_top, dim=-1)
                top_lps, top_ids = values.tolist(), ids.tolist()
            for j, i in enumerate(index):
                top_n = num_top[i]
                d = {token_ids[i]: chosen_lps[j]}
                for t, v in zip(top_ids[j][:top_n], top_lps[j][:top_n]):
                    d.setdefault(t, v)
                logprobs[i] = d
                ranks[i] = rank_list[j]
        return logprobs, ranks


# -- helpers -------------------------------------------------------------------------------------


def _chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_FLOATS // vocab)  # 65 rows of a 32k vocabulary


def _rows(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """A fresh contiguous copy of x[index] (off the CPU; the CPU copies into a kept buffer)."""
    if index == list(range(x.shape[0])):
        return x.clone(memory_format=torch.contiguous_format)
    return x.index_select(0, torch.tensor(index, dtype=torch.long, device=x.device))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax (the first maximum on ties). On CPU float32 rows kvserve's C++ argmax on
    torch's threads (gemv.Gemv.argmax; ~2x NumPy's at batch 64), else NumPy's SIMD argmax,
    several times faster than torch's for 32k-wide rows."""
    if x.device.type == "cpu":
        g = gemv.load() if gemv.Gemv.takes_argmax(x) else None
        if g is not None:
            return g.argmax(x)
        return torch.from_numpy(x.numpy().argmax(axis=-1)).long()
    return x.argmax(dim=-1)


def _softmax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    try:
        torch.ops.aten._softmax.out(x, -1, False, out=out)  # no fresh [rows, vocab] tensor
    except (AttributeError, RuntimeError):  # pragma: no cover - an ATen without this overload
        out.copy_(torch.softmax(x, dim=-1))


def _log_softmax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    try:
        torch.ops.aten._log_softmax.out(x, -1, False, out=out)
    except (AttributeError, RuntimeError):  # pragma: no cover - an ATen without this overload
        out.copy_(torch.log_softmax(x, dim=-1))
