"""Paged attention in plain PyTorch, for the CPU.

Decodes are the hot path: every step, each running sequence reads its whole cached K/V. They are
batched into one `index_select` of their blocks into a reused scratch buffer (a fresh tensor
would pay page faults on every layer of every step) and one SDPA call with an additive length
mask. Prefill chunks run one SDPA call each: with no cached context the new K/V are used as they
are (plain causal attention), otherwise the context blocks are gathered and a causal mask offset
by the context length is applied.

A quantized pool (kv/quant.py) is read through `KVTensorPool.gather`, which dequantizes only the
blocks a step reads, straight into the dtype attention runs in; and every prefill then attends
over the stored (quantized) K/V of its own tokens too, as decodes do, so a token's attention
never depends on whether its context came from this chunk, an earlier one or the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.quant import KIVIStep, ResidualAt
from kvserve.kv.tensors import KVTensorPool
from kvserve.model.attention.base import AttentionBackend, AttentionMetadata, SequenceSlice


@dataclass
class _PrefillPlan:
    seq: SequenceSlice
    gather_index: torch.Tensor | None  # block ids covering seq_len; None when no context
    mask: torch.Tensor | None  # [query_len, padded_len] bool, True = attend
    residual_at: ResidualAt = None  # int4 keys read from the residual (quantized pools)
    blocks: torch.Tensor | None = None  # block ids covering seq_len, always


@dataclass
class _StepState:
    prefills: list[_PrefillPlan]
    decode_index: torch.Tensor | None  # [num_decodes * max_blocks] block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] additive
    decode_max_blocks: int
    kivi: KIVIStep | None = None  # int4: the step's residual plan
    decode_residual_at: ResidualAt = None


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVTensorPool, scale: float) -> None:
        super().__init__(pool, scale)
        k0 = self.kv_caches[0][0]
        self._num_kv_heads = pool.codecs[0].heads
        self._head_dim = pool.codecs[0].head_dim
        self._scratch_k = torch.empty(0, dtype=k0.dtype)
        self._scratch_v = torch.empty(0, dtype=k0.dtype)

    # -- per step ---------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> _StepState:
        kivi = None
        if self.pool.residual is not None:
            seqs = sorted(meta.prefills + meta.decodes, key=lambda s: s.start)
            kivi = self.pool.begin_step(
                [(s.block_table, s.seq_len - s.query_len, s.seq_len) for s in seqs],
                meta.num_tokens)
        prefills = [self._plan_prefill(seq) for seq in meta.prefills]
        if not meta.decodes:
            return _StepState(prefills, None, None, 0, kivi)
        bs = self.block_size
        max_blocks = max(len(s.block_table[: _ceil_div(s.seq_len, bs)]) for s in meta.decodes)
        table = torch.zeros(len(meta.decodes), max_blocks, dtype=torch.long)
        for i, s in enumerate(meta.decodes):
            blocks = s.block_table[: _ceil_div(s.seq_len, bs)]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        lens = torch.tensor([s.seq_len for s in meta.decodes], dtype=torch.long)
        positions = torch.arange(max_blocks * bs)
        mask = torch.zeros(len(meta.decodes), 1, 1, max_blocks * bs, dtype=torch.float32)
        mask.masked_fill_((positions[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
        index = table.view(-1)
        if self.pool.quantized:
            return _StepState(prefills, index, mask, max_blocks, kivi,
                              self.pool.residual_lookup(index))
        self._ensure_scratch(len(meta.decodes) * max_blocks)
        return _StepState(prefills, index, mask, max_blocks)

    def _plan_prefill(self, seq: SequenceSlice) -> _PrefillPlan:
        context = seq.seq_len - seq.query_len
        bs = self.block_size
        blocks = torch.tensor(seq.block_table[: _ceil_div(seq.seq_len, bs)], dtype=torch.long)
        if context == 0 and not self.pool.quantized:
            # Plain causal attention over the new K/V (unless they are stored in another
            # float type than the model's: `_causal_mask` then builds the mask on demand).
            return _PrefillPlan(seq, None, None, blocks=blocks)
        return _PrefillPlan(seq, blocks, _causal_mask(seq, len(blocks) * bs),
                            self.pool.residual_lookup(blocks), blocks)

    # -- per layer --------------------------------------------------------------------------
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, state: _StepState) -> torch.Tensor:
        if self.pool.quantized or k.dtype != self._dtype():
            # Through the codec: quantized, or stored in another float type than the model's.
            return self._forward_quantized(layer_idx, q, k, v, meta, state)
        k_cache, v_cache = self.kv_caches[layer_idx]
        hkv, d = self._num_kv_heads, self._head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for plan in state.prefills:
            rows = slice(plan.seq.start, plan.seq.start + plan.seq.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, plan)
        if state.decode_index is not None:
            start = meta.num_prefill_tokens
            out[start:] = self._decode(q[start:], k_cache, v_cache, state)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: _PrefillPlan) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if plan.gather_index is None:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            hkv, d = self._num_kv_heads, self._head_dim
            kh = k_cache.index_select(0, plan.gather_index).view(1, -1, hkv, d).transpose(1, 2)
            vh = v_cache.index_select(0, plan.gather_index).view(1, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=plan.mask, scale=self.scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                state: _StepState) -> torch.Tensor:
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
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=state.decode_mask,
                                           scale=self.scale, enable_gqa=True)
        return o.squeeze(2).to(q.dtype)

    def _forward_quantized(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, meta: AttentionMetadata, state: _StepState
                           ) -> torch.Tensor:
        """Store (quantizing), then attend over the dequantized blocks each sequence reads."""
        self.pool.store(layer_idx, k, v, meta.slot_mapping, state.kivi)
        hkv, d = self._num_kv_heads, self._head_dim
        out = torch.empty_like(q)
        for plan in state.prefills:
            rows = slice(plan.seq.start, plan.seq.start + plan.seq.query_len)
            if plan.mask is None:
                plan.mask = _causal_mask(plan.seq, len(plan.blocks) * self.block_size)
            kb, vb = self.pool.gather(layer_idx, plan.blocks, q.dtype, plan.residual_at)
            kh = kb.view(1, -1, hkv, d).transpose(1, 2)
            vh = vb.view(1, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), kh, vh,
                                               attn_mask=plan.mask, scale=self.scale,
                                               enable_gqa=True)
            out[rows] = o.squeeze(0).transpose(0, 1)
        if state.decode_index is not None:
            start = meta.num_prefill_tokens
            n = q.shape[0] - start
            # Straight into float32: the decode SDPA runs in it anyway (see _decode).
            kb, vb = self.pool.gather(layer_idx, state.decode_index, torch.float32,
                                      state.decode_residual_at)
            kh = kb.view(n, -1, hkv, d).transpose(1, 2)
            vh = vb.view(n, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[start:].float().unsqueeze(2), kh, vh,
                                               attn_mask=state.decode_mask, scale=self.scale,
                                               enable_gqa=True)
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


def _causal_mask(seq: SequenceSlice, padded: int) -> torch.Tensor:
    """[query_len, padded] bool, True = attend: each new token sees the context and itself."""
    context = seq.seq_len - seq.query_len
    return torch.arange(padded)[None, :] <= torch.arange(context, seq.seq_len)[:, None]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
