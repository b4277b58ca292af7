"""Document reuse's selective recompute, CacheBlend's way (kvserve/blend/select.py, selection
"deviation"): a blended request's step runs every position through the first layers; after
layer `check_layer` each placed document keeps the rows whose fresh K/V deviate most from the
stored (placed) ones, and the other rows leave the forward. Their slots keep the stored K/V in
the later layers (and the fresh K/V in the first ones, which are the exact values there).

Why deviation at one layer chooses for all: the K/V of a token move with the text before it
that the stored document never saw; the tokens that moved most in an early layer are the ones
whose attention that text changed most, and they go on moving in the later layers (the
paper's observation: the high-deviation tokens of adjacent layers overlap). Layer 0 cannot
choose: its K/V are the token's embedding projected, the same in any context.

The step's other sequences (prefills, decodes, verifications) keep every row; only their rows'
flat indices shift, and `remap` moves the runner's sampled and prompt-logprob rows with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import AttentionBackend, AttentionFn, AttentionMetadata, \
    SequenceSlice


@dataclass
class _Span:
    """One placed document's rows in the flat batch and how many of them stay."""

    rows: torch.Tensor  # flat row indices, int64
    keep: int


class RowSelection:
    """The `between` hook of CausalLM.forward for one step (built by `row_selection`)."""

    def __init__(self, backend: AttentionBackend, meta: AttentionMetadata, layer: int,
                 spans: list[_Span], num_rows: int) -> None:
        self.backend = backend
        self.meta = meta
        self.layer = layer
        self.spans = spans
        self.num_rows = num_rows
        self.index: torch.Tensor | None = None  # old flat row -> new, once cut
        rows = torch.cat([s.rows for s in spans])
        self._slots = meta.slot_mapping[rows].to(backend.pool.device)
        self._stored = self._read()  # the placed K/V, before this step overwrites them

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.backend.pool.layers[self.layer][:2]
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        return (k_cache.view(-1, heads, dim)[self._slots].float(),
                v_cache.view(-1, heads, dim)[self._slots].float())

    def deviation(self) -> torch.Tensor:
        """Per candidate row: the squared distance of its fresh K and V from the stored."""
        k, v = self._read()
        old_k, old_v = self._stored
        return (k - old_k).square().sum((1, 2)) + (v - old_v).square().sum((1, 2))

    def __call__(self, layer_idx: int, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, AttentionFn] | None:
        if layer_idx != self.layer:
            return None
        deviation = self.deviation()
        keep = torch.ones(self.num_rows, dtype=torch.bool)
        at = 0
        for span in self.spans:
            n = span.rows.shape[0]
            mine = deviation[at:at + n]
            at += n
            dropped = torch.ones(n, dtype=torch.bool)
            if span.keep > 0:
                dropped[torch.topk(mine, min(span.keep, n)).indices.cpu()] = False
            keep[span.rows[dropped]] = False
        self.index = torch.cumsum(keep, 0) - 1
        meta = shrink(self.meta, keep)
        rows = keep.nonzero().squeeze(1).to(hidden.device)
        return rows, self.backend.bind(meta)

    def remap(self, rows: list[int]) -> list[int]:
        """Flat row indices of the whole step -> indices into the forward's output."""
        if self.index is None:
            return rows
        return self.index[torch.tensor(rows, dtype=torch.long)].tolist()


def shrink(meta: AttentionMetadata, keep: torch.Tensor) -> AttentionMetadata:
    """The step's metadata for the rows `keep` (bool over its flat rows) says stay. A slice
    that loses rows must carry their positions (a blended request's does)."""
    before = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(keep, 0)]).tolist()

    def cut(sl: SequenceSlice) -> SequenceSlice:
        start, end = before[sl.start], before[sl.start + sl.query_len]
        if end - start == sl.query_len:
            positions = sl.positions
        elif sl.positions is None:
            raise ValueError("only rows at given positions can leave the forward")
        else:
            positions = sl.positions[keep[sl.start:sl.start + sl.query_len]]
        out = SequenceSlice(start, end - start, sl.seq_len, sl.block_table, sl.observe_start,
                            sl.observe_len, sl.key)
        out.positions = positions
        return out

    prefills = [cut(s) for s in meta.prefills]
    return AttentionMetadata(meta.slot_mapping[keep.to(meta.slot_mapping.device)], prefills,
                             [cut(s) for s in meta.decodes],
                             sum(s.query_len for s in prefills))


def row_selection(backend: AttentionBackend, meta: AttentionMetadata,
                  chosen: list[tuple[SequenceSlice, tuple[tuple[int, int, int], ...], int]],
                  num_rows: int) -> RowSelection | None:
    """The step's RowSelection, or None when no placed row can leave (every span keeps all
    its rows). `chosen`: each choosing request's slice, its spans (first position, end,
    rows to keep) and its check layer; one check layer serves the step (the config's)."""
    spans: list[_Span] = []
    layer = 0
    for sl, choose, check_layer in chosen:
        layer = min(check_layer, len(backend.pool.layers) - 1)
        positions = sl.positions
        for first, end, count in choose:
            inside = ((positions >= first) & (positions < end)).nonzero().squeeze(1)
            if count < inside.shape[0]:
                spans.append(_Span(inside + sl.start, count))
    if not spans or layer >= len(backend.pool.layers) - 1:
        return None  # (past the last layer there is nothing left to save)
    return RowSelection(backend, meta, layer, spans, num_rows)
