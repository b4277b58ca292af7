"""Speculative decoding's verification: a drafting sequence's k + 1 logits rows into the
tokens it keeps.

A sequence that drafted d_1..d_k computed its last verified token and the k drafts in one
forward; row j of its logits is the distribution of the token after d_j (row 0: after the last
verified token). Row j is processed exactly as the sampler would process it had d_1..d_j been
sampled in earlier steps: penalties and min_tokens see those drafts as output, so what comes
out is what decoding one token at a time would give.

* Greedy rows: the target token of each row is its argmax; the drafts are kept while they
  agree, then the first disagreeing row's token (or, all agreeing, the last row's: the bonus
  token) ends the run. Token for token what non-speculative greedy decoding yields.
* Random rows: rejection sampling for a deterministic draft (a draft distribution that is one
  token with probability 1): d_j is kept with probability p_j(d_j); on rejection the token is
  drawn from p_j with d_j removed and renormalised, which makes the kept token's distribution
  exactly p_j. Every draw comes from the request's own generator when it is seeded, so a
  seeded request is reproducible (its drafts are a function of its tokens).

Logprobs are the raw ones of each kept token's row, as the sampler reports for a plain row.
Sequences without drafts in the same step are sampled together in one call, as before.
"""

from __future__ import annotations

import torch

from kvserve.sampler import GREEDY_EPS, Sampler, SamplingRow
from kvserve.worker.step import SeqSampling, StepInput, StepOutput

Tokens = tuple[list[int], list[dict[int, float] | None]]


def sample_with_drafts(sampler: Sampler, states: dict[str, SeqSampling], step: StepInput,
                       out: StepOutput) -> None:
    """Fill `out` for a step in which some sequences drafted: `out.sampled` becomes one entry
    per sequence, `out.tokens` its last kept token, `out.accepted` the drafts it kept before
    that (with their logprobs); each state's output gets every kept token."""
    groups = _groups(out.sampled)
    plain = [(i, row) for i, row, count in groups if count == 1]
    tokens: dict[int, Tokens] = {}
    if plain:
        _sample_plain(sampler, states, step, out, plain, tokens)
    for i, row, count in groups:
        if count == 1:
            continue
        seq = step.seqs[i]
        try:
            tokens[i] = verify(sampler, out.logits[row:row + count], states[seq.request_id],
                               seq.token_ids[len(seq.token_ids) - seq.num_draft:])
        except Exception as exc:  # this request's own fault: it alone fails
            out.failed[seq.request_id] = exc
    out.sampled = [i for i, _, _ in groups]
    out.tokens, out.logprobs, out.accepted = [], [], {}
    for i in out.sampled:
        kept, logprobs = tokens.get(i, ([None], [None]))
        out.tokens.append(kept[-1])
        out.logprobs.append(logprobs[-1])
        if kept[-1] is None:
            continue
        states[step.seqs[i].request_id].output_token_ids.extend(kept)
        if len(kept) > 1:
            out.accepted[i] = (kept[:-1], logprobs[:-1])


def _groups(sampled: list[int]) -> list[tuple[int, int, int]]:
    """(seq index, first logits row, rows) of each sequence; its rows are consecutive."""
    groups: list[tuple[int, int, int]] = []
    for row, i in enumerate(sampled):
        if groups and groups[-1][0] == i:
            j, first, count = groups[-1]
            groups[-1] = (j, first, count + 1)
        else:
            groups.append((i, row, 1))
    return groups


def _sample_plain(sampler: Sampler, states: dict[str, SeqSampling], step: StepInput,
                  out: StepOutput, plain: list[tuple[int, int]], tokens: dict[int, Tokens]
                  ) -> None:
    """The sequences without drafts, in one sampler call (row by row should it raise)."""
    rows = [_row(states[step.seqs[i].request_id], step.bitmask_rows.get(i)) for i, _ in plain]
    logits = out.logits[[row for _, row in plain]]
    try:
        result = sampler(logits, rows, step.bitmask)
        for (i, _), token, lp in zip(plain, result.token_ids, result.logprobs):
            tokens[i] = ([token], [lp])
        return
    except Exception:
        pass
    for k, (i, _) in enumerate(plain):
        try:
            row = rows[k]
            mask = None
            if row.bitmask_row is not None:
                mask = step.bitmask[row.bitmask_row:row.bitmask_row + 1]
                row = _row(states[step.seqs[i].request_id], 0)
            one = sampler(logits[k:k + 1], [row], mask)
            tokens[i] = (one.token_ids, one.logprobs)
        except Exception as exc:
            out.failed[step.seqs[i].request_id] = exc


def _row(s: SeqSampling, bitmask_row: int | None, extra: list[int] = ()) -> SamplingRow:
    output = s.output_token_ids + list(extra) if extra else s.output_token_ids
    return SamplingRow(s.params, output, s.prompt_token_ids, s.generator, s.eos_token_ids,
                       bitmask_row)


def verify(sampler: Sampler, logits: torch.Tensor, state: SeqSampling, draft: list[int]
           ) -> Tokens:
    """The tokens a sequence keeps from its k + 1 rows (`logits`) and its k drafts: the
    accepted drafts, then one token sampled (the correction or the bonus)."""
    assert logits.shape[0] == len(draft) + 1, "one row per draft, and one more"
    rows = [_row(state, None, draft[:j]) for j in range(len(draft) + 1)]
    if state.params.temperature < GREEDY_EPS:
        result = sampler(logits, rows)
        targets = result.token_ids
        n = _agreeing(targets, draft)
        return targets[:n + 1], result.logprobs[:n + 1]
    kept = _rejection_sample(sampler, logits, rows, draft, state.generator)
    if state.params.logprobs is None:
        return kept, [None] * len(kept)
    logprobs, _ = sampler.token_logprobs(logits[:len(kept)], kept,
                                         [state.params.logprobs] * len(kept))
    return kept, logprobs


def _agreeing(targets: list[int], draft: list[int]) -> int:
    n = 0
    while n < len(draft) and targets[n] == draft[n]:
        n += 1
    return n


def _rejection_sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                      draft: list[int], generator: torch.Generator | None) -> list[int]:
    """Accept d_j with probability p_j(d_j); on rejection draw from p_j without d_j; all
    accepted, draw the bonus token from the last row."""
    gen = generator if generator is not None else sampler.generator
    probs = sampler.distribution(logits, rows).double()
    kept: list[int] = []
    for j, d in enumerate(draft):
        p = probs[j]
        if torch.rand((), generator=gen, dtype=torch.float64) < p[d]:
            kept.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        kept.append(_draw(residual, gen))
        return kept
    kept.append(_draw(probs[len(draft)], gen))
    return kept


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the (not necessarily normalised) distribution `p`."""
    cdf = torch.cumsum(p, dim=0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp(max=len(p) - 1)[0])
