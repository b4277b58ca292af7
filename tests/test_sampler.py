"""The sampler against independent references.

Top-k, top-p, min-p, temperature and repetition penalty are checked against transformers' own
logits processors; frequency/presence penalties, min_tokens and logprobs against formulas
computed here in float64; the draw against the distribution it should follow (empirical
frequencies over many draws); seeded requests for batch-independence; and a hypothesis property
for "never outside the allowed set" under random parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import kvserve.sampler.sampler as sampler_module
from kvserve.sampler import SampleResult, Sampler, SamplingRow
from kvserve.sampling import SamplingParams

NEG_INF = float("-inf")


def make_row(output=(), prompt=(), generator=None, eos=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), output_token_ids=list(output),
                       prompt_token_ids=list(prompt), generator=generator, eos_token_ids=set(eos))


# -- references ----------------------------------------------------------------------------------


def hf_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """transformers' warpers, in generate()'s order, on one row; the renormalised distribution."""
    scores = logits.detach().float().clone().unsqueeze(0)
    ids = torch.zeros((1, 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.softmax(scores.double(), dim=-1)[0].numpy()


def penalised_reference(logits: torch.Tensor, prompt, output, repetition=1.0, frequency=0.0,
                        presence=0.0) -> torch.Tensor:
    """Repetition penalty by transformers' processor over prompt + output, then the OpenAI
    frequency/presence formula by hand."""
    scores = logits.float().clone().unsqueeze(0)
    seen = list(prompt) + list(output)
    if repetition != 1.0 and seen:
        scores = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([seen]), scores)
    out = scores[0].double()
    for token in set(output):
        count = list(output).count(token)
        out[token] -= frequency * count + presence * (count > 0)
    return out


def log_softmax64(logits: torch.Tensor) -> np.ndarray:
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def probs_after_top_k_top_p(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """float64 helper for choosing unambiguous parameters: softmax(z) restricted to top-k and
    top-p (ties impossible for continuous random logits)."""
    p = np.exp(z - z.max())
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum_before = np.cumsum(p[order]) - p[order]
        keep_sorted = cum_before < top_p
        keep = np.zeros_like(keep)
        keep[order[keep_sorted]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def safe_top_p(z: np.ndarray, top_k: int, rng: np.random.Generator, max_keep: int) -> float:
    """A top_p halfway between two cumulative sums of the (top-k restricted) distribution, with a
    margin no float rounding can cross."""
    p = np.sort(probs_after_top_k_top_p(z, top_k, 1.0))[::-1]
    cum = np.cumsum(p)
    choices = [j for j in range(1, min(max_keep, len(p) - 1)) if p[j] > 2e-6 and cum[j - 1] < 0.999]
    if not choices:  # e.g. top_k 1: nothing left for top-p to cut
        return 1.0
    j = int(rng.choice(choices))
    return float((cum[j - 1] + cum[j]) / 2)  # keeps exactly j + 1 tokens


def safe_min_p(z: np.ndarray, top_k: int, top_p: float, rng: np.random.Generator) -> float:
    p = probs_after_top_k_top_p(z, top_k, top_p)
    ratios = np.sort(p[p > 0] / p.max())[::-1]
    choices = [j for j in range(1, len(ratios)) if ratios[j - 1] - ratios[j] > 1e-3]
    if not choices:
        return 0.0
    j = int(rng.choice(choices))
    return float((ratios[j - 1] + ratios[j]) / 2)


# -- greedy ----------------------------------------------------------------------------------------


def test_all_greedy_is_one_argmax_on_the_fast_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy fast path must not reach this")

    for name in ("apply_logit_changes", "topk_topp_threshold", "_rows"):
        monkeypatch.setattr(sampler_module, name, forbidden)
    for name in ("_sample", "_probs", "_draw", "token_logprobs"):
        monkeypatch.setattr(Sampler, name, forbidden)
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(0))
    # Sampling knobs other than temperature mean nothing for a greedy row.
    rows = [make_row(temperature=0.0, top_k=5 * (i % 2), top_p=0.5 + 0.5 * (i % 3 == 0))
            for i in range(64)]
    result = Sampler()(logits, rows)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 64


def test_greedy_ties_take_the_first_maximum_and_tiny_temperature_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 0.0]])
    assert Sampler()(logits, [make_row(temperature=0.0)] * 2).token_ids == [1, 0]
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    result = Sampler()(logits, [make_row(temperature=1e-6)] * 32)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_and_the_input_is_untouched():
    logits = torch.randn(12, 500, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = []
    for i in range(12):
        if i % 3 == 0:
            rows.append(make_row(temperature=0.0))
        elif i % 3 == 1:
            rows.append(make_row(temperature=0.8, top_p=0.9, min_p=0.01))
        else:
            rows.append(make_row(temperature=0.0, output=[1, 2, 2], prompt=[3],
                                 repetition_penalty=1.3, frequency_penalty=0.5))
    result = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    for i in range(0, 12, 3):
        assert result.token_ids[i] == int(logits[i].argmax())
    for i in range(2, 12, 3):
        ref = penalised_reference(logits[i], [3], [1, 2, 2], 1.3, 0.5)
        assert result.token_ids[i] == int(ref.argmax())


def test_non_float32_logits_are_accepted():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    result = Sampler()(logits, [make_row(temperature=0.0)] * 2 + [make_row(top_k=3)] * 2)
    assert result.token_ids[:2] == logits.float()[:2].argmax(dim=-1).tolist()
    assert len(result.token_ids) == 4


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, 10), [make_row()] * 2)


# -- filters against transformers -----------------------------------------------------------------


def filter_cases(vocab: int, n: int, seed: int, max_keep: int):
    """Random logits with parameters whose cuts are unambiguous, covering each knob alone and
    combined."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((n, vocab)).astype(np.float32) * 2.5)
    cases = []
    for i in range(n):
        temperature = float(rng.choice([1.0, 0.6, 1.7]))
        kind = i % 6
        top_k = int(rng.integers(1, min(max_keep, vocab))) if kind in (0, 3, 5) else 0
        z = logits[i].double().numpy() / temperature
        top_p = safe_top_p(z, top_k, rng, max_keep) if kind in (1, 3, 4, 5) else 1.0
        min_p = safe_min_p(z, top_k, top_p, rng) if kind in (2, 4, 5) else 0.0
        cases.append(dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    return logits, cases


@pytest.mark.parametrize("vocab, max_keep", [(64, 64), (300, 300), (32000, 3000)])
def test_filtered_distribution_matches_transformers(vocab, max_keep):
    """Small vocabularies sort whole rows; 32k rows take the partition path, and cuts beyond
    its candidates (max_keep 3000 > 1024) take the fallback."""
    logits, cases = filter_cases(vocab, 24 if vocab < 32000 else 12, seed=vocab, max_keep=max_keep)
    rows = [make_row(**c) for c in cases]
    ours = Sampler().distribution(logits, rows).double().numpy()
    for i, c in enumerate(cases):
        ref = hf_probs(logits[i], **c)
        np.testing.assert_array_equal(ours[i] > 0, ref > 0, err_msg=f"support differs for {c}")
        np.testing.assert_allclose(ours[i], ref, rtol=1e-4, atol=1e-7, err_msg=str(c))


def test_partition_path_peaked_flat_and_large_top_k():
    """32k vocab: a peaked row (cut inside the candidates), a flat row (cut far below them), a
    top-k larger than the candidate count with and without top-p."""
    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(32000, generator=gen) * 0.5
    peaked = torch.randn(32000, generator=gen) * 2.0
    peaked[:50] += 12.0
    logits = torch.stack([peaked, flat, flat, peaked, flat])
    rng = np.random.default_rng(0)
    cases = [dict(top_p=safe_top_p(peaked.double().numpy(), 0, rng, 60)),
             dict(top_p=safe_top_p(flat.double().numpy(), 0, rng, 31000)),
             dict(top_k=5000),
             dict(top_k=2000, top_p=safe_top_p(peaked.double().numpy(), 2000, rng, 2000)),
             dict(top_k=20000, top_p=safe_top_p(flat.double().numpy(), 20000, rng, 20000))]
    ours = Sampler().distribution(logits, [make_row(**c) for c in cases]).double().numpy()
    for i, c in enumerate(cases):
        ref = hf_probs(logits[i], **c)
        np.testing.assert_array_equal(ours[i] > 0, ref > 0, err_msg=str(c))
        np.testing.assert_allclose(ours[i], ref, rtol=1e-4, atol=1e-9, err_msg=str(c))
    assert (ours[2] > 0).sum() == 5000
    # Only flat rows: every row of the chunk sorts its whole row.
    flat_only = Sampler().distribution(logits[[1, 4]], [make_row(**cases[1]), make_row(**cases[4])])
    np.testing.assert_allclose(flat_only.double().numpy(), ours[[1, 4]], rtol=1e-6, atol=1e-12)


def test_draws_stay_in_the_transformers_support():
    logits, cases = filter_cases(80, 12, seed=7, max_keep=40)
    copies = 400
    rows = [make_row(**c) for c in cases for _ in range(copies)]
    tokens = Sampler(seed=1)(logits.repeat_interleave(copies, dim=0), rows).token_ids
    for i, c in enumerate(cases):
        support = set(np.flatnonzero(hf_probs(logits[i], **c) > 0).tolist())
        drawn = set(tokens[i * copies:(i + 1) * copies])
        assert drawn <= support, (c, drawn - support)
        if len(support) <= 5:
            assert drawn == support  # every allowed token shows up in 400 draws


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    for k in (1, 2, 3, 4):
        ours = Sampler().distribution(logits, [make_row(top_k=k)])[0].double().numpy()
        np.testing.assert_array_equal(ours > 0, hf_probs(logits[0], top_k=k) > 0)


# -- the draw ---------------------------------------------------------------------------------


def assert_frequencies_match(tokens: list[int], probs: np.ndarray) -> None:
    n = len(tokens)
    counts = np.bincount(np.asarray(tokens), minlength=len(probs))
    expected = n * probs
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 2), np.c_[counts, expected][:40]
    assert np.all(counts[probs == 0] == 0)
    used = expected > 5  # Pearson chi-square over the well-populated bins
    chi2 = float((((counts - expected) ** 2)[used] / expected[used]).sum())
    dof = int(used.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("vocab", [20, 300])  # 300: one full draw block plus a short tail block
def test_empirical_distribution_matches_softmax_over_temperature(vocab):
    gen = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=gen) * 1.5
    if vocab > 256:
        row[256:] += 2.0  # put real mass in the short last block
    temperature = 0.7
    n = 20000
    tokens = Sampler(seed=3)(row.expand(n, vocab), [make_row(temperature=temperature)] * n)
    ref = torch.softmax(row.double() / temperature, dim=-1).numpy()
    assert_frequencies_match(tokens.token_ids, ref)


def test_empirical_distribution_after_filters_matches_transformers():
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(60, generator=gen) * 2.0
    rng = np.random.default_rng(1)
    z = row.double().numpy() / 1.3
    params = dict(temperature=1.3, top_k=30)
    params["top_p"] = safe_top_p(z, 30, rng, 25)
    params["min_p"] = safe_min_p(z, 30, params["top_p"], rng)
    n = 20000
    tokens = Sampler(seed=4)(row.expand(n, 60), [make_row(**params)] * n).token_ids
    assert_frequencies_match(tokens, hf_probs(row, **params))


def test_seeded_rows_draw_from_the_right_distribution():
    row = torch.randn(30, generator=torch.Generator().manual_seed(12))
    n = 6000
    rows = [make_row(seed=i, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    tokens = Sampler()(row.expand(n, 30), rows).token_ids
    assert_frequencies_match(tokens, torch.softmax(row.double(), dim=-1).numpy())


def test_large_mixed_batch_matches_rows_taken_alone():
    """Vocab 25000 puts 83 random rows in a workspace chunk, so this batch is processed in
    two chunks, with changed (penalised) and plain rows interleaved. Every row's distribution
    must be what it is alone, and plain rows must match transformers."""
    vocab, batch = 25000, 130
    assert sampler_module._chunk_rows(vocab) < batch * 5 // 7
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(batch, vocab, generator=gen) * 2.0
    kinds = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.0), dict(min_p=0.02, temperature=1.3),
             dict(top_k=40, seed=3), dict(temperature=0.0, repetition_penalty=1.5),
             dict(temperature=0.9, frequency_penalty=1.0, presence_penalty=0.5)]
    rows = [make_row(output=[1, 5, 5, 9], prompt=[2, 3], **kinds[i % len(kinds)])
            for i in range(batch)]
    sampler = Sampler()
    together = sampler.distribution(logits, rows)
    for i in range(0, batch, 9):
        alone = sampler.distribution(logits[i:i + 1], [rows[i]])[0]
        torch.testing.assert_close(together[i], alone, rtol=1e-6, atol=1e-9)
    for i in range(2, batch, 21):  # the temperature-only kind
        ref = torch.softmax(logits[i].double(), dim=-1).float()
        torch.testing.assert_close(together[i], ref, rtol=1e-4, atol=1e-9)
    for i in range(1, batch, 35):  # the top-p kind
        ref = torch.from_numpy(hf_probs(logits[i], temperature=0.7, top_p=0.8))
        assert torch.equal(together[i] > 0, ref > 0)

    # Seeded rows draw the same tokens in this batch as alone.
    def seeded_rows():
        return [make_row(output=[1, 5, 5, 9], prompt=[2, 3],
                         generator=torch.Generator().manual_seed(i), **kinds[i % len(kinds)])
                for i in range(batch)]
    batched = Sampler(seed=5)(logits, seeded_rows()).token_ids
    fresh = seeded_rows()
    for i in range(4, batch, 14):
        assert Sampler(seed=6)(logits[i:i + 1], [fresh[i]]).token_ids[0] == batched[i]


def test_non_contiguous_logits_and_tensor_token_ids():
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(6, 3, 700, generator=gen) * 2
    logits = hidden[:, -1, :]  # a strided view, as a model's last position would give
    assert not logits.is_contiguous()
    output, prompt = [4, 4, 8], [1, 2, 3, 4]
    as_lists = [make_row(temperature=0.0), make_row(top_p=0.7, temperature=0.9),
                make_row(output=output, prompt=prompt, repetition_penalty=1.4,
                         frequency_penalty=0.3, logprobs=2)]
    as_tensors = [as_lists[0], as_lists[1],
                  SamplingRow(as_lists[2].params, output_token_ids=torch.tensor(output),
                              prompt_token_ids=np.array(prompt))]
    dense = logits.contiguous()
    expected = Sampler().distribution(dense, as_lists * 2)
    torch.testing.assert_close(Sampler().distribution(logits, as_tensors * 2), expected)
    result = Sampler(seed=2)(logits, as_tensors * 2)
    assert result.token_ids == Sampler(seed=2)(dense, as_lists * 2).token_ids
    assert result.token_ids[0] == int(dense[0].argmax())
    ref = penalised_reference(dense[2], prompt, output, 1.4, 0.3)
    torch.testing.assert_close(expected[2].double(), torch.softmax(ref, dim=-1), rtol=1e-5,
                               atol=1e-8)


# -- seeds -----------------------------------------------------------------------------------------


def run_request(seed: int, step_logits: torch.Tensor, batched: bool) -> list[int]:
    """One seeded request over several steps, alone or inside changing batches."""
    params = dict(temperature=0.9, top_p=0.95, min_p=0.001, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    sampler = Sampler(seed=99 if batched else 0)
    rng = np.random.default_rng(seed + 1000)
    tokens: list[int] = []
    vocab = step_logits.shape[1]
    for step, logits in enumerate(step_logits):
        mine = make_row(output=tokens, generator=generator, **params)
        if not batched:
            tokens.append(sampler(logits.unsqueeze(0), [mine]).token_ids[0])
            continue
        others = [make_row(temperature=0.0),
                  make_row(temperature=1.2, top_k=7),
                  make_row(temperature=0.5, output=[1, 1, 2], repetition_penalty=1.5,
                           frequency_penalty=1.0),
                  make_row(seed=7, generator=torch.Generator().manual_seed(7 + step)),
                  make_row(temperature=1.0)]
        others = [others[j] for j in rng.permutation(len(others))[: rng.integers(1, 6)]]
        position = int(rng.integers(0, len(others) + 1))
        batch = others[:position] + [mine] + others[position:]
        batch_logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(step))
        batch_logits[position] = logits
        tokens.append(sampler(batch_logits, batch).token_ids[position])
    return tokens


def test_seeded_request_is_the_same_alone_and_batched():
    step_logits = torch.randn(12, 2000, generator=torch.Generator().manual_seed(21)) * 0.3
    alone = run_request(42, step_logits, batched=False)
    assert run_request(42, step_logits, batched=True) == alone
    assert run_request(42, step_logits, batched=False) == alone
    assert run_request(43, step_logits, batched=False) != alone


def test_two_requests_with_the_same_seed_in_one_batch_agree():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(22)).expand(4, 1000)
    rows = [make_row(seed=5, generator=torch.Generator().manual_seed(5)) for _ in range(3)]
    rows.append(make_row(seed=6, generator=torch.Generator().manual_seed(6)))
    sampler = Sampler()
    results = [sampler(logits, rows).token_ids for _ in range(10)]
    assert all(r[0] == r[1] == r[2] for r in results)
    assert [r[0] for r in results] != [r[3] for r in results]


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(50, 1000)
    rows = [make_row()] * 50
    assert Sampler(seed=1)(logits, rows).token_ids == Sampler(seed=1)(logits, rows).token_ids
    assert Sampler(seed=1)(logits, rows).token_ids != Sampler(seed=2)(logits, rows).token_ids


# -- penalties and min_tokens ---------------------------------------------------------------------


def test_penalties_match_the_references():
    gen = torch.Generator().manual_seed(31)
    vocab = 50
    logits = torch.randn(6, vocab, generator=gen) * 2
    prompt = [3, 4, 4, 10, 49]
    output = [4, 7, 7, 7, 12, 0]
    knobs = [dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
             dict(frequency_penalty=0.8), dict(presence_penalty=-1.2),
             dict(frequency_penalty=-0.4, presence_penalty=1.5),
             dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)]
    rows = [make_row(output=output, prompt=prompt, **k) for k in knobs]
    ours = Sampler().distribution(logits, rows).double()
    for i, k in enumerate(knobs):
        ref = penalised_reference(logits[i], prompt, output, k.get("repetition_penalty", 1.0),
                                  k.get("frequency_penalty", 0.0), k.get("presence_penalty", 0.0))
        torch.testing.assert_close(ours[i], torch.softmax(ref, dim=-1), rtol=1e-5, atol=1e-7)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 1.0, -2.0], [5.0, 4.9, 1.0, -2.0], [-1.0, -1.1, -3.0, -5.0]])
    rows = [make_row(temperature=0.0, output=[0], repetition_penalty=1.1),
            make_row(temperature=0.0, output=[0, 0], frequency_penalty=0.1),
            # negative logit: multiplied, so token 0 drops below token 1
            make_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]
    assert Sampler()(logits, rows).token_ids == [1, 1, 1]


def test_out_of_vocabulary_history_ids_are_ignored():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    rows = [make_row(temperature=0.0, prompt=[5, 7], output=[3], repetition_penalty=2.0,
                     presence_penalty=2.0),
            make_row(temperature=0.0)]
    assert Sampler()(logits, rows).token_ids == [2, 0]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.5, 0.0, 0.0, 8.0, 0.0, 0.0]])
    eos = {3}

    def pick(output, **kw):
        row = make_row(temperature=0.0, output=output, eos=eos, stop_token_ids=[7], **kw)
        return Sampler()(logits, [row]).token_ids[0]

    assert pick([], min_tokens=2) == 2
    assert pick([1], min_tokens=2) == 2
    assert pick([1, 1], min_tokens=2) == 3  # min_tokens reached: EOS allowed again
    assert pick([1], min_tokens=2, ignore_eos=True) == 3  # EOS is no stop token then
    row = make_row(output=[1], eos=eos, stop_token_ids=[7], min_tokens=3)
    drawn = Sampler()(logits.expand(3000, 10), [row] * 3000).token_ids
    assert not {3, 7} & set(drawn)
    dist = Sampler().distribution(logits, [row])[0].double()
    ref = logits[0].double().clone()
    ref[[3, 7]] = NEG_INF
    torch.testing.assert_close(dist, torch.softmax(ref, dim=-1), rtol=1e-5, atol=1e-8)


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_top_n_plus_the_sampled_token():
    gen = torch.Generator().manual_seed(41)
    logits = torch.randn(6, 100, generator=gen) * 3
    rows = [make_row(temperature=0.0, logprobs=5),
            make_row(temperature=1.5, top_p=0.5, logprobs=3),
            make_row(temperature=0.7, output=[1, 2], repetition_penalty=1.4,
                     frequency_penalty=1.0, logprobs=4),
            make_row(temperature=5.0, logprobs=0),
            make_row(temperature=1.0),
            make_row(temperature=50.0, top_k=90, logprobs=1)]
    for seed in range(5):
        result = Sampler(seed=seed)(logits, rows)
        assert isinstance(result, SampleResult)
        assert result.logprobs[4] is None and result.ranks[4] is None
        for i, row in enumerate(rows):
            n = row.params.logprobs
            if n is None:
                continue
            ref = log_softmax64(logits[i])
            token = result.token_ids[i]
            got = result.logprobs[i]
            top = set(np.argsort(-ref)[:n].tolist())
            assert set(got) == top | {token}
            assert len(got) in (n, n + 1)
            for t, v in got.items():
                assert v == pytest.approx(ref[t], abs=1e-5)
            assert result.ranks[i] == 1 + int((ref > ref[token]).sum())
    assert Sampler()(logits, rows).ranks[0] == 1


# -- property --------------------------------------------------------------------------------------


def allowed_tokens(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """A float64 statement of what may be sampled, with a small tolerance at every cut, so that
    it is a superset of any correct implementation's support."""
    p = row.params
    z = logits.astype(np.float64).copy()
    if len(row.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        z[list(banned)] = -np.inf
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for t in seen:
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        count = list(row.output_token_ids).count(t)
        z[t] -= p.frequency_penalty * count + p.presence_penalty
    finite = np.isfinite(z)
    top = z[finite].max()
    if p.temperature < 1e-5:
        return finite & (z >= top - 1e-4 * (1 + abs(top)))
    y = (z - top) / p.temperature
    prob = np.exp(y)
    tol = 1e-4
    allowed = finite.copy()
    if 0 < p.top_k < len(z):
        kth = np.sort(y)[::-1][p.top_k - 1]
        allowed &= y >= kth - tol * (1 + abs(kth))
        strict = y >= kth
    else:
        strict = finite
    q = np.where(strict, prob, 0.0)
    q /= q.sum()
    above = np.array([q[y > y[t] + tol].sum() for t in range(len(z))])
    allowed &= above < p.top_p + tol
    allowed &= prob >= p.min_p * prob.max() * (1 - tol)
    return allowed


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(2, 40))
    rows, logits = [], []
    for _ in range(draw(st.integers(1, 4))):
        values = draw(st.lists(st.one_of(st.floats(-30, 30, width=32), st.just(NEG_INF)),
                               min_size=vocab, max_size=vocab))
        token = st.integers(0, vocab - 1)
        seed = draw(st.one_of(st.none(), st.integers(0, 2**31)))
        row = make_row(
            output=draw(st.lists(token, max_size=6)),
            prompt=draw(st.lists(token, max_size=6)),
            eos=draw(st.sets(token, max_size=2)),
            generator=None if seed is None else torch.Generator().manual_seed(seed),
            seed=seed,
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 5.0))),
            top_k=draw(st.integers(0, vocab + 2)),
            top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
            frequency_penalty=draw(st.floats(-2.0, 2.0)),
            presence_penalty=draw(st.floats(-2.0, 2.0)),
            min_tokens=draw(st.integers(0, 3)),
            stop_token_ids=draw(st.lists(token, max_size=2)),
            ignore_eos=draw(st.booleans()),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 3))))
        banned = set(row.params.stop_token_ids) | (
            set() if row.params.ignore_eos else set(row.eos_token_ids))
        usable = [t for t, v in enumerate(values)
                  if v != NEG_INF and (len(row.output_token_ids) >= row.params.min_tokens
                                       or t not in banned)]
        assume(usable)  # the precondition: something is left to sample
        rows.append(row)
        logits.append(values)
    return torch.tensor(logits, dtype=torch.float32), rows


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases())
def test_property_sampled_tokens_are_always_allowed(case):
    logits, rows = case
    copies = 8
    batch_logits = logits.repeat_interleave(copies, dim=0)
    batch_rows = [r for r in rows for _ in range(copies)]
    result = Sampler(seed=0)(batch_logits, batch_rows)
    for i, token in enumerate(result.token_ids):
        assert 0 <= token < logits.shape[1]
        assert batch_logits[i, token] != NEG_INF
        allowed = allowed_tokens(batch_logits[i].numpy(), batch_rows[i])
        assert allowed[token], (token, np.flatnonzero(allowed), batch_rows[i].params)
        if batch_rows[i].params.logprobs is not None:
            assert token in result.logprobs[i]
    dist = Sampler().distribution(logits, rows).double().numpy()
    assert np.allclose(dist.sum(axis=1), 1.0, atol=1e-5)
    for i, row in enumerate(rows):
        assert not (dist[i] > 0)[~allowed_tokens(logits[i].numpy(), row)].any()


# -- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_matches_the_reference_and_leaves_other_rows_alone():
    """Rows with a bias draw from softmax((logits + bias, then OpenAI's penalties) / T),
    computed here by hand; rows without one in the same batch are untouched (same
    distribution as alone), and logprobs stay the raw ones."""
    gen = torch.Generator().manual_seed(53)
    vocab = 64
    logits = torch.randn(5, vocab, generator=gen) * 2
    bias = {3: 5.0, 17: -100.0, 40: 2.5, 63: -0.5}
    rows = [make_row(temperature=0.7, logit_bias=bias),
            make_row(temperature=1.3),
            make_row(temperature=1.0, output=[3, 3, 8], frequency_penalty=0.5,
                     repetition_penalty=1.2, prompt=[40], logit_bias={3: 1.0, 8: -3.0}),
            make_row(temperature=0.9, top_k=5),
            make_row(temperature=1.0, logit_bias={})]
    ours = Sampler().distribution(logits, rows).double()
    biased = logits[0].double().clone()
    for t, b in bias.items():
        biased[t] += b
    torch.testing.assert_close(ours[0], torch.softmax(biased / 0.7, dim=-1), rtol=1e-5,
                               atol=1e-8)
    with_pen = logits[2].clone()
    with_pen[3] += 1.0
    with_pen[8] -= 3.0
    ref = penalised_reference(with_pen, [40], [3, 3, 8], 1.2, 0.5, 0.0)
    torch.testing.assert_close(ours[2], torch.softmax(ref, dim=-1), rtol=1e-5, atol=1e-8)
    for i in (1, 3, 4):  # untouched rows: as when sampled alone without any bias around
        alone = Sampler().distribution(logits[i:i + 1], [rows[i]]).double()[0]
        torch.testing.assert_close(ours[i], alone, rtol=0, atol=0)
    torch.testing.assert_close(ours[4], torch.softmax(logits[4].double(), dim=-1), rtol=1e-5,
                               atol=1e-8)


def test_logit_bias_forces_and_bans_greedy_tokens_and_keeps_raw_logprobs():
    logits = torch.tensor([[5.0, 4.0, 1.0, -2.0], [5.0, 4.0, 1.0, -2.0], [5.0, 4.0, 1.0, -2.0]])
    rows = [make_row(temperature=0.0, logit_bias={3: 100.0}, logprobs=1),
            make_row(temperature=0.0, logit_bias={0: -100.0}),
            make_row(temperature=0.0)]
    result = Sampler()(logits, rows)
    assert result.token_ids == [3, 1, 0]
    raw = log_softmax64(logits[0])
    assert result.logprobs[0][3] == pytest.approx(raw[3], abs=1e-5)
    drawn = Sampler()(logits[:1].expand(2000, 4), [make_row(logit_bias={0: -100.0, 1: -100.0})]
                      * 2000).token_ids
    assert not {0, 1} & set(drawn)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, {"1": 1.0}, {1: float("nan")},
                                  {True: 1.0}, [1, 2]])
def test_invalid_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
