"""The draw: one uniform number per row (from the request's own generator when it is seeded),
turned into a token by inverse-CDF sampling in two levels. Why two levels: a full-vocabulary
cumulative sum per row is the costliest array of a step; block masses and one block are not."""

from __future__ import annotations

import torch

from kvserve.sampler.rows import SamplingRow

_DRAW_BLOCK = 256  # the draw picks a block of this many tokens first, then a token in it


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one uniform number per row, in two levels so that no full-vocab
    cumsum is built: pick a block of _DRAW_BLOCK tokens by the blocks' masses, then a token
    inside it. torch's CPU cumsum accumulates each row sequentially, so every CDF here is
    non-decreasing and a zero-probability block or token occupies an empty interval that
    `searchsorted(..., right=True)` never lands in; targets stay strictly below each CDF's
    end. Both levels (a few hundred values per row) work in float64. `u`: one uniform number
    in [0, 1) per row (`uniforms`)."""
    n, vocab = probs.shape
    device = probs.device
    blk = min(_DRAW_BLOCK, vocab)
    n_full = vocab // blk
    mass = probs[:, : n_full * blk].reshape(n, n_full, blk).sum(dim=-1)
    if n_full * blk < vocab:
        mass = torch.cat([mass, probs[:, n_full * blk:].sum(dim=-1, keepdim=True)], dim=1)
    u = u.to(device)
    block, frac = _invert(mass.double().cumsum(dim=-1), u)
    token = block.unsqueeze(1) * blk + torch.arange(blk, device=device)
    inside = probs.gather(1, token.clamp(max=vocab - 1))
    inside.masked_fill_(token >= vocab, 0.0)  # the short last block
    offset, _ = _invert(inside.double().cumsum(dim=-1), frac)
    return block * blk + offset


def uniforms(rows: list[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    """One float64 in [0, 1) per row: from the row's own generator when its request is seeded
    (so a seeded request draws the same whatever batch it is in), else from `generator`."""
    seeded = [j for j, r in enumerate(rows) if r.generator is not None]
    if not seeded:
        return torch.rand(len(rows), generator=generator, dtype=torch.float64)
    u = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[torch.tensor(unseeded)] = torch.rand(len(unseeded), generator=generator,
                                               dtype=torch.float64)
    for j in seeded:  # one draw per seeded row and step, whatever else is in the batch
        u[j] = torch.rand((), generator=rows[j].generator, dtype=torch.float64)
    return u


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
