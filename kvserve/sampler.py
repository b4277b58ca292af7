"""The sampler: turns one step's logits into one token per sequence.

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.kernels.cpu import gemv
from kvserve.sampling import SamplingParams
from kvserve.structured.bitmask import apply_bitmask

__all__ = ["GREEDY_EPS", "SampleResult", "Sampler", "SamplingRow"]

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature samples greedily
_CANDIDATES = 1024  # top-k/top-p first look for their cut among each row's top 1024 tokens
_DRAW_BLOCK = 256  # the draw picks a block of this many tokens first, then a token in it
_CHUNK_FLOATS = 1 << 21  # random rows go in chunks whose workspace buffers stay within 8 MiB


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
            logits = _check(logits, rows, token_bitmask)
            plan = _Plan(rows, token_bitmask)
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
            logits = _check(logits, rows, token_bitmask)
            return self._sample(logits, rows, _Plan(rows, token_bitmask), want_probs=True)

    # -- selection -------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan,
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
            _apply_logit_changes(copy, [(j, rows[i]) for j, i in enumerate(changed)],
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
                cut = _topk_topp_threshold(scratch.copy_(probs), ks, ps)
                threshold = torch.maximum(threshold, cut)
            else:
                at = torch.tensor(sort_rows, device=device)
                sortable = torch.index_select(probs, 0, at, out=scratch[: len(sort_rows)])
                threshold[at] = torch.maximum(threshold[at], _topk_topp_threshold(sortable, ks, ps))
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
        """Inverse-CDF draw, one uniform number per row, in two levels so that no full-vocab
        cumsum is built: pick a block of _DRAW_BLOCK tokens by the blocks' masses, then a token
        inside it. torch's CPU cumsum accumulates each row sequentially, so every CDF here is
        non-decreasing and a zero-probability block or token occupies an empty interval that
        `searchsorted(..., right=True)` never lands in; targets stay strictly below each CDF's
        end. Both levels (a few hundred values per row) work in float64."""
        n, vocab = probs.shape
        device = probs.device
        blk = min(_DRAW_BLOCK, vocab)
        n_full = vocab // blk
        mass = probs[:, : n_full * blk].reshape(n, n_full, blk).sum(dim=-1)
        if n_full * blk < vocab:
            mass = torch.cat([mass, probs[:, n_full * blk:].sum(dim=-1, keepdim=True)], dim=1)
        u = self._uniforms(rows).to(device)
        block, frac = _invert(mass.double().cumsum(dim=-1), u)
        token = block.unsqueeze(1) * blk + torch.arange(blk, device=device)
        inside = probs.gather(1, token.clamp(max=vocab - 1))
        inside.masked_fill_(token >= vocab, 0.0)  # the short last block
        offset, _ = _invert(inside.double().cumsum(dim=-1), frac)
        return block * blk + offset

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

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        seeded = [j for j, r in enumerate(rows) if r.generator is not None]
        if not seeded:
            return torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        u = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [j for j, r in enumerate(rows) if r.generator is None]
        if unseeded:
            u[torch.tensor(unseeded)] = torch.rand(len(unseeded), generator=self.generator,
                                                   dtype=torch.float64)
        for j in seeded:  # one draw per seeded row and step, whatever else is in the batch
            u[j] = torch.rand((), generator=rows[j].generator, dtype=torch.float64)
        return u


# -- helpers -------------------------------------------------------------------------------------


def _check(logits: torch.Tensor, rows: Sequence[SamplingRow],
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


class _Plan:
    """Which rows need what this step."""

    def __init__(self, rows: Sequence[SamplingRow],
                 token_bitmask: torch.Tensor | None = None) -> None:
        self.token_bitmask = token_bitmask  # the step's grammar bitmasks (SamplingRow.bitmask_row)
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
    if len(row.output_token_ids) < p.min_tokens and _min_tokens_banned(row):
        return True
    if p.repetition_penalty != 1.0 and (len(row.prompt_token_ids) or len(row.output_token_ids)):
        return True
    penalised = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return penalised and len(row.output_token_ids) > 0


def _min_tokens_banned(row: SamplingRow) -> set[int]:
    banned = set(row.params.stop_token_ids or ())
    if not row.params.ignore_eos:
        banned.update(row.eos_token_ids)
    return banned


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


def _ids(token_ids: Sequence[int], offset: int, vocab: int) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        t = token_ids.reshape(-1).long().cpu()
    else:  # NumPy converts a list of ints about 4x faster than torch.tensor
        t = torch.from_numpy(np.asarray(token_ids, dtype=np.int64).reshape(-1))
    t = t[(t >= 0) & (t < vocab)]  # an id outside the vocabulary must not touch another row
    return t + offset


def _apply_logit_changes(work: torch.Tensor, changed: list[tuple[int, SamplingRow]],
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
        assert token_bitmask is not None  # _check
        apply_bitmask(work, token_bitmask, masked)

    banned: list[int] = []
    for j, row in changed:  # a grammar decides alone where its output ends
        if len(row.output_token_ids) < row.params.min_tokens and row.bitmask_row is None:
            banned.extend(j * vocab + t for t in _min_tokens_banned(row) if 0 <= t < vocab)
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


def _topk_topp_threshold(probs: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Per row, the smallest probability that survives top-k then top-p.

    `probs`: [n, vocab] softmax rows in a scratch buffer that is reordered in place; ks in
    1..vocab (vocab = no top-k); ps in (0, 1] (1 = no top-p)."""
    n, vocab = probs.shape
    device = probs.device
    k = torch.tensor(ks, device=device)
    p = torch.tensor(ps, dtype=torch.float64, device=device)
    total = probs.sum(dim=-1).double()
    if device.type != "cpu":
        return _cut_from_sorted(probs.sort(dim=-1).values, k, p, total, vocab)[0]
    arr = probs.numpy()
    if vocab <= 2 * _CANDIDATES:
        arr.sort(axis=-1)
        return _cut_from_sorted(probs, k, p, total, vocab)[0]

    arr.partition(vocab - _CANDIDATES, axis=-1)  # the top _CANDIDATES values last, unordered
    top = arr[:, vocab - _CANDIDATES:]
    top.sort(axis=-1)
    threshold, more = _cut_from_sorted(torch.from_numpy(top), k, p, total, vocab)
    lower = more.nonzero().flatten()  # rows whose cut lies lower: sort the whole row
    if len(lower) == n:  # typical of flat distributions: all rows at once, in place
        arr[:, : vocab - _CANDIDATES].sort(axis=-1)
        threshold = _cut_from_sorted(probs, k, p, total, vocab)[0]
    elif len(lower):
        for j in lower.tolist():
            arr[j, : vocab - _CANDIDATES].sort()
        threshold[lower] = _cut_from_sorted(probs.index_select(0, lower), k[lower], p[lower],
                                            total[lower], vocab)[0]
    return threshold


def _cut_from_sorted(asc: torch.Tensor, k: torch.Tensor, p: torch.Tensor, total: torch.Tensor,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`asc`: [n, L] each row's L largest probabilities, ascending. Returns the top-k/top-p
    threshold per row and whether a row needs more than its L largest values to decide it.

    Top-p keeps the smallest set of most likely tokens (within the top-k set) whose mass is at
    least top_p of that set's mass: a token is dropped when the tokens above it already reach
    top_p. With cumulative sums c over the ascending row, the tokens above position j weigh
    c[L-1] - c[j], so j is dropped iff c[j] <= c[L-1] - top_p * mass."""
    length = asc.shape[1]
    k_in = k.clamp(max=length)
    start = length - k_in  # the top-k set is asc[start:]
    dropped = start
    if bool((p < 1.0).any()):
        if bool((start > 0).any()):  # leave out what top-k drops
            in_top_k = torch.arange(length, device=asc.device) >= start.unsqueeze(1)
            cdf = torch.where(in_top_k, asc, 0.0).cumsum(dim=-1)  # accumulated in double on CPU
        else:
            cdf = asc.cumsum(dim=-1)
        kept_mass = cdf[:, -1].double()
        no_top_k = k >= vocab
        mass = torch.where(no_top_k, total, kept_mass)  # the mass top-p is relative to
        cut = (kept_mass - p * mass).clamp(min=0.0).to(cdf.dtype).unsqueeze(1)
        by_p = torch.searchsorted(cdf, cut, right=True).squeeze(1)
        dropped = torch.where(p < 1.0, torch.maximum(by_p, start), start)
        more = no_top_k & (kept_mass < p * mass) if length < vocab else torch.zeros_like(no_top_k)
    else:
        more = torch.zeros(len(k), dtype=torch.bool, device=asc.device)
    if length < vocab:
        more |= (k < vocab) & (k > length)  # a top-k larger than the candidates
    keep_from = dropped.clamp(max=length - 1)  # the most likely token always stays
    return asc.gather(1, keep_from.unsqueeze(1)).squeeze(1), more


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the index i with cdf[i-1] <= u * cdf[-1] < cdf[i], and where inside that
    interval the target fell, as a fraction in [0, 1]."""
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # (The clamp only matters for a row without any probability mass, which the precondition
    # excludes: it then gets some token instead of an indexing error.)
    index = torch.searchsorted(cdf, target.unsqueeze(1), right=True).clamp(max=cdf.shape[1] - 1)
    hi = cdf.gather(1, index).squeeze(1)
    lo = torch.where(index.squeeze(1) > 0, cdf.gather(1, (index - 1).clamp(min=0)).squeeze(1),
                     torch.zeros_like(hi))
    frac = torch.where(hi > lo, (target - lo) / (hi - lo), torch.zeros_like(hi))
    return index.squeeze(1), frac.clamp(0.0, 1.0)  # 1.0 is kept below the end by the caller
