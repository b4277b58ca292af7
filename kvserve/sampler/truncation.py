"""Top-k and top-p as one per-row probability threshold (step 4 of the sampler's order).

Why a threshold and not a mask: a sort of probability values (NumPy's, ~15x torch's on CPU) over
each row's `_CANDIDATES` largest finds the cut; the sampler then drops what lies below it in
vocabulary order, so no token is moved and no index array is built."""

from __future__ import annotations

import torch

_CANDIDATES = 1024  # top-k/top-p first look for their cut among each row's top 1024 tokens


def topk_topp_threshold(probs: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
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
