"""Paged attention in plain PyTorch, for the CPU.

Decodes are the hot path: every step, each running sequence reads its whole cached K/V. They are
batched into one `index_select` of their blocks into a reused scratch buffer (a fresh tensor
would pay page faults on every layer of every step) and one SDPA call with an additive length
mask. Prefill chunks run one SDPA call each: with no cached context the new K/V are used as they
are (plain causal attention), otherwise the context blocks are gathered and a causal mask offset
by the context length is applied.

Sliding-window layers (`AttentionBackend.windows`) get their own gather indices and masks, built
once per step for each distinct window: only the blocks that hold a position some query of the
step can see are gathered (so a windowed layer reads about W tokens, not the whole context, and
never a block older than its window), and the mask also hides keys more than W - 1 positions
behind their query.

Decodes read the cache in place through the paged C++ kernel (cpu_paged.py) where it can be
built: every storage format (float32/bfloat16/float16, fp8, int8, int4), full and sliding
layers (a per-sequence first visible position). Without it (no compiler, or
KVSERVE_CPU_PAGED_DECODE=0) they take the gather path above.

A quantized pool (kv/quant.py), or a float pool of another type than the model's (the backend
is told the model's dtype at construction), goes "through the codec": new K/V are stored by
`KVTensorPool.store`, and prefills read through `KVTensorPool.gather`, which dequantizes only
the blocks a step reads, straight into the dtype attention runs in; every prefill then attends
over the stored (quantized) K/V of its own tokens too, as decodes do, so a token's attention
never depends on whether its context came from this chunk, an earlier one or the prefix cache.
It uses the same per-window gather indices and masks, so windowed layers stay in their window.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from kvserve.utils.features import DETERMINISTIC, INT4, refuse
from kvserve.kv.bounded import snapkv_votes
from kvserve.kv.quant import KIVIStep, ResidualAt
from kvserve.kv.spec import first_needed_block, first_visible
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention import cpu_paged
from kvserve.attention.softcap import sdpa
from kvserve.attention.base import (AttentionBackend, AttentionMetadata, SequenceSlice,
                                    ceil_div, padded_block_tables)


@dataclass
class _PrefillPlan:
    seq: SequenceSlice
    # Block ids from the first block a query can see up to seq_len; None: no context, the new
    # K/V are used as they are (never through a codec: it always reads the stored K/V).
    gather_index: torch.Tensor | None
    # [query_len, gathered_len] bool, True = attend; None with no context and causal alone.
    mask: torch.Tensor | None
    residual_at: ResidualAt = None  # int4 keys read from the residual (quantized pools)


@dataclass
class _WindowState:
    """A step's gather indices and masks for the layers of one window (None = full)."""

    prefills: list[_PrefillPlan]
    decode_index: torch.Tensor | None  # [num_decodes * max_blocks] block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] additive
    decode_max_blocks: int
    decode_residual_at: ResidualAt = None  # int4 keys of decode_index read from the residual
    # Set instead of decode_index / decode_mask when the paged kernel runs (cpu_paged.py).
    paged: _PagedDecodes | None = None

    @functools.cached_property
    def runs(self) -> list[list[_PrefillPlan]]:
        """The prefills in runs that one attention call serves (see _prefill_runs); found
        when first asked (the path through the codecs never asks)."""
        return _prefill_runs(self.prefills)


def _prefill_runs(plans: list[_PrefillPlan]) -> list[list[_PrefillPlan]]:
    """The plans in order, consecutive ones grouped where one batched causal attention call
    serves them all: no context to gather, no mask, no SnapKV observation, the same length, and
    rows that follow one another. Why: a step of 64 fresh 128-token prompts made 64 SDPA calls
    per layer; one call over [64, heads, 128, D] took 14.2 instead of 17-18 ms per layer."""
    def fresh(plan: _PrefillPlan) -> bool:
        return plan.gather_index is None and plan.mask is None and not plan.seq.observe_len

    runs: list[list[_PrefillPlan]] = []
    for plan in plans:
        last = runs[-1][-1] if runs else None
        if last is not None and fresh(plan) and fresh(last) \
                and last.seq.query_len == plan.seq.query_len \
                and last.seq.start + last.seq.query_len == plan.seq.start:
            runs[-1].append(plan)
        else:
            runs.append([plan])
    return runs


@dataclass
class _PagedDecodes:
    """The paged kernel's inputs for a step's rows in the layers of one window: its decodes,
    or (deterministic) every row of the step, one per token, each as a decode of its own
    position."""

    tables: torch.Tensor  # [rows, max_blocks] int64, zero-padded
    lens: torch.Tensor  # [rows] int64: each row's position + 1
    starts: torch.Tensor | None  # [rows] first visible position (sliding layers)
    res_rows: torch.Tensor | None  # int4: [rows, max_blocks] residual row, -1 none
    step: cpu_paged.PagedStep | None = None  # the above packed for the kernel (per window)
    first_row: int = 0  # the step's row of the first of them (its prefill tokens, or 0)


@dataclass
class _StepState:
    by_window: dict[int | None, _WindowState]
    kivi: KIVIStep | None = None  # int4: the step's residual plan (every layer, every window)
    # (row in the batch, slice) of the decodes whose attention weights H2O observes: found
    # once per step, not by a loop over every decode in every layer (~0.2 ms of a batch-64 step)
    observing: list[tuple[int, SequenceSlice]] = field(default_factory=list)
    # Deterministic: the prefills whose SnapKV observation queries `_observe` reads (their
    # attention itself runs in the kernel with the decodes')
    observing_prefills: list[SequenceSlice] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    observes_attention = True  # `_observe`: SnapKV / H2O votes into `observed`

    def __init__(self, pool: KVTensorPool, scale: float, dtype: torch.dtype | None = None,
                 softcap: float | None = None, deterministic: bool = False) -> None:
        """`dtype`: the model's (q, k, v) dtype; None: a float pool's own. A float pool of
        another dtype is read and written through the codec, decided here once. `softcap`:
        Gemma 2's attention logit soft-capping (attention/softcap.py; the paged C++ kernel
        has none, so decodes then take the gather path). `deterministic`: every row, prefill
        rows too, through the paged kernel (see `_paged_rows`)."""
        super().__init__(pool, scale)
        self.softcap = softcap
        self.deterministic = deterministic
        k0 = self.kv_caches[0][0]
        self._num_kv_heads = pool.codecs[0].heads
        self._head_dim = pool.codecs[0].head_dim
        self._scratch_k = torch.empty(0, dtype=k0.dtype)
        self._scratch_v = torch.empty(0, dtype=k0.dtype)
        self.model_dtype = dtype if dtype is not None else k0.dtype
        self.through_codec = pool.quantized or self.model_dtype != k0.dtype
        # Decodes read the cache in place (cpu_paged.py) when every layer's storage fits the
        # kernel; otherwise (or without a compiler) the gather path below. Setting
        # `paged_kernel = None` forces the gather path.
        self.paged_kernel = None
        self._paged_kv = [cpu_paged.paged_kv(c, parts, i)
                          for i, (c, parts) in enumerate(zip(pool.codecs, pool.layers))]
        if all(kv is not None for kv in self._paged_kv) and softcap is None:
            self.paged_kernel = cpu_paged.load_kernel()
        if deterministic and pool.block_state is not None:  # the features table's reason
            refuse(DETERMINISTIC, INT4)
        if deterministic and self.paged_kernel is None:  # (soft-capping: refused at start-up)
            raise ValueError(
                "deterministic inference runs every attention row through the paged CPU "
                "kernel, which this engine cannot use: "
                + ("a layer's cache layout it does not read" if not all(self._paged_kv)
                   else "the kernel could not be built (a C++ compiler; "
                        "KVSERVE_CPU_PAGED_DECODE=0)"))
        # Layers whose PagedKV can change after construction are built again at each decode:
        # int4's (its residual tensors are allocated on first use) and those whose fp8 scales
        # the first batch still has to calculate (calculate_kv_scales: until calibrated).
        scales = pool.scales
        self._uncalibrated = set() if scales is None else \
            {layer for layer, done in enumerate(scales.calibrated) if not done}
        self._kivi = pool.block_state is not None

    # -- per step ---------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> _StepState:
        self.observed = {}  # nothing a failed step left behind
        kivi = None
        if self.pool.block_state is not None:
            # Before any gather index is planned: `state_lookup` reads this step's rows.
            seqs = sorted(meta.prefills + meta.decodes, key=lambda s: s.start)
            kivi = self.pool.begin_step(
                [(s.block_table, s.seq_len - s.query_len, s.seq_len) for s in seqs],
                meta.num_tokens)
        paged = None
        if self.deterministic:
            paged = self._paged_rows(sorted(meta.prefills, key=lambda s: s.start)
                                     + meta.decodes, 0)  # the rows in q's order
        elif self.paged_kernel is not None:
            paged = self._paged_rows(meta.decodes, meta.num_prefill_tokens)
        observing = [(meta.num_prefill_tokens + j, seq) for j, seq in enumerate(meta.decodes)
                     if seq.observe_len]
        return _StepState({w: self._prepare_window(meta, w, paged) for w in set(self.windows)},
                          kivi, observing,
                          [s for s in meta.prefills if s.observe_len] if self.deterministic
                          else [])

    def _paged_rows(self, seqs: list[SequenceSlice], first_row: int) -> _PagedDecodes | None:
        """Tables, lengths (and int4's residual rows) of the kernel's rows, one per token of
        `seqs` (the step's rows from `first_row` on, in order), shared by every window;
        `_prepare_window` adds each window's first visible positions.

        Deterministic inference (issue 64) gives every row, prefill rows too, to the kernel as
        a decode of its own position (length position + 1, its sequence's table): a token's
        attention is then the same operations in the same order whether it came in a prompt
        of 900 tokens, in a 24-token tail after a cached head, as a decode, a verification
        row or beside other requests. (SDPA's bits depend on the query count, the padded key
        count and causal against masked; consecutive rows of one sequence are the kernel's
        verification rows, which keep each row's bits alone and read the keys once a group.)"""
        if not seqs:
            return None
        counts = [s.query_len for s in seqs]
        tables = torch.tensor(padded_block_tables(seqs, self.block_size), dtype=torch.long)
        if any(n != 1 or s.positions is not None for n, s in zip(counts, seqs)):
            tables = tables.repeat_interleave(torch.tensor(counts), dim=0)
            lens = torch.cat([s.positions.to(torch.long) + 1 if s.positions is not None
                              else torch.arange(s.seq_len - s.query_len + 1, s.seq_len + 1)
                              for s in seqs])
        else:
            lens = torch.tensor([s.seq_len for s in seqs], dtype=torch.long)
        res_rows = None
        where = self.pool.state_lookup(tables.view(-1))
        if where is not None:
            res_rows = torch.full((tables.numel(),), -1, dtype=torch.long)
            res_rows[where[0]] = where[1]
            res_rows = res_rows.view(tables.shape)
        return _PagedDecodes(tables, lens, None, res_rows, first_row=first_row)

    def _prepare_window(self, meta: AttentionMetadata, window: int | None,
                        paged: _PagedDecodes | None) -> _WindowState:
        if self.deterministic and paged is not None:  # every row in the kernel
            return _WindowState([], None, None, 0, paged=self._window_step(paged, window))
        prefills = [self._plan_prefill(seq, window, self.through_codec) for seq in meta.prefills]
        if not meta.decodes:
            return _WindowState(prefills, None, None, 0)
        bs = self.block_size
        if paged is not None:
            return _WindowState(prefills, None, None, 0, paged=self._window_step(paged, window))
        spans = [_block_span(s.seq_len - 1, s.seq_len, window, bs) for s in meta.decodes]
        max_blocks = max(last - first for first, last in spans)
        # Short rows are padded with their own last block (masked out): a padding entry never
        # points at a block the sequence does not hold.
        table = torch.tensor([s.block_table[first:last]
                              + [s.block_table[last - 1]] * (max_blocks - last + first)
                              for s, (first, last) in zip(meta.decodes, spans)],
                             dtype=torch.long)
        lens = torch.tensor([s.seq_len for s in meta.decodes], dtype=torch.long)
        firsts = torch.tensor([first_visible(s.seq_len - 1, window) for s in meta.decodes],
                              dtype=torch.long)
        key_pos = torch.tensor([first * bs for first, _ in spans], dtype=torch.long)[:, None] \
            + torch.arange(max_blocks * bs)[None, :]
        hidden = (key_pos >= lens[:, None]) | (key_pos < firsts[:, None])
        mask = torch.zeros(len(meta.decodes), 1, 1, max_blocks * bs, dtype=torch.float32)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
        index = table.view(-1)
        if self.through_codec:
            return _WindowState(prefills, index, mask, max_blocks,
                                self.pool.state_lookup(index))
        self._ensure_scratch(len(meta.decodes) * max_blocks)
        return _WindowState(prefills, index, mask, max_blocks)

    def _window_step(self, paged: _PagedDecodes, window: int | None) -> _PagedDecodes:
        """`paged` with the window's first visible positions, packed for the kernel."""
        starts = None if window is None else (paged.lens - window).clamp_(min=0)
        step = self.paged_kernel.step(paged.tables, paged.lens, starts, paged.res_rows)
        return dataclasses.replace(paged, starts=starts, step=step)

    def _plan_prefill(self, seq: SequenceSlice, window: int | None, over_cache: bool = False
                      ) -> _PrefillPlan:
        """`over_cache`: gather the stored K/V even without context (the codec path: a
        quantized pool, or one stored in another float type than the model's)."""
        context = seq.seq_len - seq.query_len
        if seq.positions is not None:  # rows at given positions (document reuse)
            first, last = _block_span(int(seq.positions[0]), seq.seq_len, window,
                                      self.block_size)
            blocks = torch.tensor(seq.block_table[first:last], dtype=torch.long)
            k_pos = torch.arange(first * self.block_size, last * self.block_size)
            return _PrefillPlan(seq, blocks, _window_mask(seq.positions, k_pos, window),
                                self.pool.state_lookup(blocks))
        if context == 0 and not over_cache:
            if window is None or seq.query_len <= window:
                return _PrefillPlan(seq, None, None)  # plain causal over the new tokens
            pos = torch.arange(seq.query_len)
            return _PrefillPlan(seq, None, _window_mask(pos, pos, window))
        first, last = _block_span(context, seq.seq_len, window, self.block_size)
        blocks = torch.tensor(seq.block_table[first:last], dtype=torch.long)
        q_pos = torch.arange(context, seq.seq_len)
        k_pos = torch.arange(first * self.block_size, last * self.block_size)
        return _PrefillPlan(seq, blocks, _window_mask(q_pos, k_pos, window),
                            self.pool.state_lookup(blocks))

    # -- per layer --------------------------------------------------------------------------
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, step: _StepState) -> torch.Tensor:
        if self.through_codec:
            return self._forward_through_codec(layer_idx, q, k, v, meta, step)
        k_cache, v_cache = self.kv_caches[layer_idx]
        if k.dtype != k_cache.dtype:
            raise ValueError(f"the attention backend was built for a {self.model_dtype} model "
                             f"over a {k_cache.dtype} cache, but got {k.dtype} K/V")
        state = step.by_window[self.windows[layer_idx]]
        hkv, d = self._num_kv_heads, self._head_dim
        # The paged kernel stores the decodes' new K/V itself (one scatter less per layer);
        # the prefill rows, which come first, are stored here.
        in_kernel = state.paged is not None and self._kernel_can_store(k, v)
        stored = state.paged.first_row if in_kernel else k.shape[0]
        if stored:
            slots = meta.slot_mapping[:stored]
            k_cache.view(-1, hkv, d).index_copy_(0, slots, k[:stored])
            v_cache.view(-1, hkv, d).index_copy_(0, slots, v[:stored])
        out = torch.empty_like(q)
        for run in state.runs:
            if len(run) > 1:
                self._prefill_run(q, k, v, out, run)
                continue
            plan = run[0]
            rows = slice(plan.seq.start, plan.seq.start + plan.seq.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, plan)
            if plan.seq.observe_len:
                self._observe(layer_idx, q[rows], k_cache, v_cache, plan.seq)
        if state.paged is not None:
            self._decode_paged(layer_idx, q, out, meta, state.paged,
                               (k[stored:], v[stored:]) if in_kernel else None)
        elif state.decode_index is not None:
            start = meta.num_prefill_tokens
            out[start:] = self._decode(q[start:], k_cache, v_cache, state)
        self._observe_step(layer_idx, q, k_cache, v_cache, step)
        return out

    def _observe_step(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, step: _StepState) -> None:
        """The attention weights of the step's observed rows that `_prefill` did not observe:
        H2O's decodes, and (deterministic) SnapKV's prefills, whose rows the kernel ran."""
        for seq in step.observing_prefills:
            rows = slice(seq.start, seq.start + seq.query_len)
            self._observe(layer_idx, q[rows], k_cache, v_cache, seq)
        for row, seq in step.observing:  # H2O: these decodes' attention weights
            self._observe(layer_idx, q[row:row + 1], k_cache, v_cache, seq)

    def kernel_args(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, meta: AttentionMetadata, step: _StepState
                    ) -> tuple[int, cpu_paged._Args] | None:
        """A decode-only step's paged-kernel arguments for this layer (the kernel stores k and
        v, attends q, writes out), where `forward` would do just that: a float cache of the
        model's dtype, no prefill rows, no decode that records attention weights (H2O)."""
        state = step.by_window[self.windows[layer_idx]]
        if self.through_codec or state.paged is None or meta.prefills or step.observing:
            return None
        if not self._kernel_can_store(k, v):
            return None
        return (self.paged_kernel.function_address,
                state.paged.step.layer_args(q, self._paged_kv[layer_idx], self.scale, out, k, v))

    def _kernel_can_store(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the paged kernel can store these new K/V rows itself (heads and D
        contiguous; the rows may be strided)."""
        d = self._head_dim
        return all(t.stride(2) == 1 and t.stride(1) == d for t in (k, v))

    def _decode_paged(self, layer_idx: int, q: torch.Tensor, out: torch.Tensor,
                      meta: AttentionMetadata, paged: _PagedDecodes,
                      new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The kernel's rows of `out` (the decodes, or every row: `_paged_rows`) through the
        paged kernel, reading the layer's stored parts (codes and scales as they are) in place;
        `new_kv`: those rows' new K/V, which the kernel stores first (a float cache of the
        model's dtype)."""
        start = paged.first_row
        if self._kivi or layer_idx in self._uncalibrated:
            self._paged_kv[layer_idx] = cpu_paged.paged_kv(
                self.pool.codecs[layer_idx], self.kv_caches[layer_idx], layer_idx)
            if not self._kivi and self.pool.scales.calibrated[layer_idx]:
                self._uncalibrated.discard(layer_idx)
        kv = self._paged_kv[layer_idx]
        dst = out[start:]
        direct = dst.dtype == torch.float32 and dst.is_contiguous()
        new_k, new_v = new_kv if new_kv is not None else (None, None)
        o = paged.step.run(q[start:], kv, self.scale, dst if direct else None, new_k, new_v)
        if not direct:
            dst.copy_(o)

    def _prefill_run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     run: list[_PrefillPlan]) -> None:
        """Causal attention of a run of fresh prefills of one length (`_prefill_runs`) in one
        call: their rows, one after another, viewed as a batch [n, heads, length, D]."""
        n, length = len(run), run[0].seq.query_len
        rows = slice(run[0].seq.start, run[0].seq.start + n * length)

        def heads(x: torch.Tensor) -> torch.Tensor:  # [n * length, h, D] -> [n, h, length, D]
            return x[rows].view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)

        o = sdpa(heads(q), heads(k), heads(v), is_causal=True, scale=self.scale,
                 softcap=self.softcap)
        out[rows] = o.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[2])

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: _PrefillPlan) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if plan.gather_index is None:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = sdpa(qh, kh, vh, attn_mask=plan.mask, is_causal=plan.mask is None,
                     scale=self.scale, softcap=self.softcap)
        else:
            hkv, d = self._num_kv_heads, self._head_dim
            kh = k_cache.index_select(0, plan.gather_index).view(1, -1, hkv, d).transpose(1, 2)
            vh = v_cache.index_select(0, plan.gather_index).view(1, -1, hkv, d).transpose(1, 2)
            o = sdpa(qh, kh, vh, attn_mask=plan.mask, scale=self.scale, softcap=self.softcap)
        return o.squeeze(0).transpose(0, 1)

    def _observe(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, seq: SequenceSlice) -> None:
        """SnapKV's raw votes for one layer: the softmaxed attention weights of the slice's
        observation queries over every key of the sequence (causal), summed over those queries
        and over the query heads of each KV head -> [kv_heads, seq_len] (`snapkv_votes`).
        Computed apart from the attention itself (SDPA does not return weights), for these
        sequences only; a window cut by chunked prefill sums to the same votes over its
        chunks."""
        n = seq.observe_len
        first = seq.seq_len - seq.query_len + seq.observe_start  # KV index of the first query
        hkv, d = self._num_kv_heads, self._head_dim
        blocks = torch.tensor(seq.block_table[:ceil_div(seq.seq_len, self.block_size)],
                              dtype=torch.long)
        keys = k_cache.index_select(0, blocks).view(-1, hkv, d)[:seq.seq_len].float()
        qo = q[seq.observe_start:seq.observe_start + n].float()  # [n, H, D]
        # GQA: query head j reads KV head j // group; grouping the query heads reads each key
        # once instead of expanding the keys per query head (a copy of the whole sequence's
        # keys, per layer, every step an H2O sequence decodes).
        qg = qo.view(n, hkv, qo.shape[1] // hkv, d)
        scores = torch.einsum("qhgd,khd->hgqk", qg, keys).reshape(qo.shape[1], n, -1)
        scores *= self.scale
        if self.softcap is not None:  # Gemma 2: the votes see the scores it attends with
            scores = scores.div_(self.softcap).tanh_().mul_(self.softcap)
        q_pos = torch.arange(first, first + n)[:, None]
        scores.masked_fill_(torch.arange(seq.seq_len)[None, :] > q_pos, float("-inf"))
        self.observed.setdefault(seq.key, []).append(
            snapkv_votes(scores.softmax(-1), hkv))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                state: _WindowState) -> torch.Tensor:
        n = q.shape[0]
        hkv, d = self._num_kv_heads, self._head_dim
        rows = state.decode_index.numel()
        kg = torch.index_select(k_cache, 0, state.decode_index, out=self._scratch_k[:rows])
        vg = torch.index_select(v_cache, 0, state.decode_index, out=self._scratch_v[:rows])
        kh = kg.view(n, -1, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
        vh = vg.view(n, -1, hkv, d).transpose(1, 2)
        qh = q.unsqueeze(2)
        if q.dtype != torch.float32:
            # PyTorch's CPU flash kernel is ~8x slower in bfloat16 than in float32 for one query
            # row per sequence; the upcast costs far less than it saves.
            qh, kh, vh = qh.float(), kh.float(), vh.float()
        o = sdpa(qh, kh, vh, attn_mask=state.decode_mask, scale=self.scale,
                 softcap=self.softcap)
        return o.squeeze(2).to(q.dtype)

    def _forward_through_codec(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, meta: AttentionMetadata, step: _StepState
                               ) -> torch.Tensor:
        """Store (quantizing or casting), then attend over the stored K/V each sequence reads:
        decodes through the paged kernel, or like prefills over the dequantized blocks of the
        layer's window's gather indices and masks, as in `forward`."""
        self.pool.store(layer_idx, k, v, meta.slot_mapping, step.kivi)
        state = step.by_window[self.windows[layer_idx]]
        hkv, d = self._num_kv_heads, self._head_dim
        out = torch.empty_like(q)
        for plan in state.prefills:
            rows = slice(plan.seq.start, plan.seq.start + plan.seq.query_len)
            kb, vb = self.pool.gather(layer_idx, plan.gather_index, q.dtype, plan.residual_at)
            kh = kb.view(1, -1, hkv, d).transpose(1, 2)
            vh = vb.view(1, -1, hkv, d).transpose(1, 2)
            o = sdpa(q[rows].transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=plan.mask,
                     scale=self.scale, softcap=self.softcap)
            out[rows] = o.squeeze(0).transpose(0, 1)
        if state.paged is not None:
            self._decode_paged(layer_idx, q, out, meta, state.paged)
        elif state.decode_index is not None:
            start = meta.num_prefill_tokens
            n = q.shape[0] - start
            # Straight into float32: the decode SDPA runs in it anyway (see _decode).
            kb, vb = self.pool.gather(layer_idx, state.decode_index, torch.float32,
                                      state.decode_residual_at)
            kh = kb.view(n, -1, hkv, d).transpose(1, 2)
            vh = vb.view(n, -1, hkv, d).transpose(1, 2)
            o = sdpa(q[start:].float().unsqueeze(2), kh, vh, attn_mask=state.decode_mask,
                     scale=self.scale, softcap=self.softcap)
            out[start:] = o.squeeze(2).to(q.dtype)
        return out

    # -- helpers ----------------------------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        return self.kv_caches[0][0].dtype

    def _ensure_scratch(self, num_blocks: int) -> None:
        if self._scratch_k.shape[0] < num_blocks:
            shape = (num_blocks,) + tuple(self.kv_caches[0][0].shape[1:])
            self._scratch_k = torch.empty(shape, dtype=self._dtype())
            self._scratch_v = torch.empty(shape, dtype=self._dtype())


def _block_span(first_query: int, seq_len: int, window: int | None, block_size: int
                ) -> tuple[int, int]:
    """[first, last) indices into a block table: the blocks holding a key that some query at
    positions >= `first_query` can see, up to the end of a sequence of `seq_len` tokens."""
    return first_needed_block(first_query, window, block_size), ceil_div(seq_len, block_size)


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool, True = attend: causal, and within the window if any."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible
