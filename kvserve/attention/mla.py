"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache, in PyTorch.

The cache holds per token and layer one vector `c = [latent (kv_lora_rank) | k_rope
(qk_rope_head_dim)]` shared by every head (`MLALatentSpec`). A head's key is
`[W_UK_h latent | k_rope]` and its value `W_UV_h latent`, where W_UK_h [qk_nope, rank] and
W_UV_h [v_head, rank] are that head's rows of `kv_b_proj`. Two ways to attend:

* decompressing (prefill and extend, and decode when asked): up-project the latents of the
  whole context to per-head keys and values, then ordinary attention. Its cost per step grows
  with context x rank x heads x (qk_nope + v_head), and it materialises per-head K/V.
* absorbed (decode, by default): scores are `q_nope_h . W_UK_h latent + q_rope_h . k_rope =
  [W_UK_h^T q_nope_h | q_rope_h] . c`, so the key up-projection is folded into the query once
  per step, and `sum_t p_t W_UV_h latent_t = W_UV_h (sum_t p_t latent_t)`, so the value
  up-projection is applied once to the attention's output. Attention then runs as multi-query
  attention straight over the cached vectors (keys: all of c; values: its latent part), and the
  cache is never decompressed: per step it reads context x (rank + rope) values per sequence.

The model hands this backend (per layer) q_nope, q_rope, the new tokens' cache vectors and the
layer's `MLAProjections`; it writes the vectors into their slots and returns [T, heads, v_head].
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.kv.spec import MLALatentSpec
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.base import (AttentionBackend, AttentionMetadata, SequenceSlice,
                                    ceil_div, padded_block_tables)

DECODE_MODES = ("absorbed", "decompress")


@dataclass
class MLAProjections:
    """One layer's up-projections out of the latent, views of its `kv_b_proj` [H*(nope+v), r]."""

    kv_b_proj: torch.Tensor  # [H * (qk_nope + v_head), rank]: decompression in one GEMM
    w_uk: torch.Tensor  # [H, qk_nope, rank]
    w_uv: torch.Tensor  # [H, v_head, rank]

    @classmethod
    def of(cls, kv_b_proj: torch.Tensor, num_heads: int, qk_nope: int,
           v_head: int) -> MLAProjections:
        per_head = kv_b_proj.view(num_heads, qk_nope + v_head, -1)
        return cls(kv_b_proj, per_head[:, :qk_nope], per_head[:, qk_nope:])

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]


# (layer_idx, q_nope [T, H, nope], q_rope [T, H, rope], c [T, rank + rope], projections)
#   -> [T, H, v_head]
MLAAttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, MLAProjections],
                          torch.Tensor]


def is_mla_pool(pool: KVTensorPool) -> bool:
    return isinstance(pool.spec.layer_specs()[0], MLALatentSpec)


@dataclass
class _PrefillPlan:
    seq: SequenceSlice
    gather_index: torch.Tensor | None  # block ids covering seq_len; None when no context
    mask: torch.Tensor | None  # [query_len, padded_len] bool, True = attend


@dataclass
class _StepState:
    prefills: list[_PrefillPlan]
    decode_table: torch.Tensor | None  # [num_decodes, max_blocks] block ids (int64; Triton int32)
    decode_lens: torch.Tensor | None  # [num_decodes] int64: KV length including the new token
    decode_mask: torch.Tensor | None  # [num_decodes, 1, max_blocks * block_size] additive
    # (the torch decode's; None on Triton, whose kernel stops at each length)


class TorchMLABackend(AttentionBackend):
    """Paged MLA in plain PyTorch (the CPU path); `decode` picks absorbed or decompressing
    decode (the latter exists to measure what absorption saves)."""

    def __init__(self, pool: KVTensorPool, scale: float, decode: str = "absorbed") -> None:
        super().__init__(pool, scale)
        spec = pool.spec.layer_specs()[0]
        if not isinstance(spec, MLALatentSpec):
            raise ValueError("the MLA backend needs a pool of MLA latent vectors")
        if decode not in DECODE_MODES:
            raise ValueError(f"MLA decode must be one of {DECODE_MODES}, got {decode!r}")
        self.rank = spec.kv_lora_rank
        self.rope_dim = spec.rope_dim
        self.width = spec.kv_lora_rank + spec.rope_dim
        self.decode_mode = decode
        self._scratch = torch.empty(0, dtype=pool.dtype, device=pool.device)

    def bind(self, meta: AttentionMetadata) -> MLAAttentionFn:  # type: ignore[override]
        state = self.prepare(meta)

        def attend(layer_idx: int, q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor,
                   proj: MLAProjections) -> torch.Tensor:
            return self.forward_mla(layer_idx, q_nope, q_rope, c, proj, meta, state)

        return attend

    def forward(self, layer_idx, q, k, v, meta, state):  # MLA attends through forward_mla
        raise TypeError("an MLA backend is called through bind() with MLA's arguments")

    # -- per step ---------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> _StepState:
        prefills = [self._plan_prefill(seq) for seq in meta.prefills]
        if not meta.decodes:
            return _StepState(prefills, None, None, None)
        table = torch.tensor(padded_block_tables(meta.decodes, self.block_size),
                             dtype=torch.long)
        lens = torch.tensor([s.seq_len for s in meta.decodes], dtype=torch.long)
        return self._decode_state(prefills, table, lens)

    def _decode_state(self, prefills: list[_PrefillPlan], table: torch.Tensor,
                      lens: torch.Tensor) -> _StepState:
        """The decodes' part of a step: what `_decode` reads (the torch decode gathers the
        latents into scratch and masks past each length)."""
        bs = self.block_size
        max_blocks = table.shape[1]
        positions = torch.arange(max_blocks * bs)
        mask = torch.zeros(len(lens), 1, max_blocks * bs, dtype=torch.float32)
        mask.masked_fill_((positions[None, :] >= lens[:, None])[:, None, :], float("-inf"))
        if self._scratch.shape[0] < table.numel():
            self._scratch = torch.empty((table.numel(), bs, 1, self.width),
                                        dtype=self.pool.dtype, device=self.pool.device)
        dev = self.pool.device
        return _StepState(prefills, table.to(dev), lens.to(dev), mask.to(dev))

    def _plan_prefill(self, seq: SequenceSlice) -> _PrefillPlan:
        context = seq.seq_len - seq.query_len
        if context == 0:
            return _PrefillPlan(seq, None, None)
        bs = self.block_size
        blocks = seq.block_table[: ceil_div(seq.seq_len, bs)]
        q_pos = torch.arange(context, seq.seq_len)[:, None]
        k_pos = torch.arange(len(blocks) * bs)[None, :]
        dev = self.pool.device
        return _PrefillPlan(seq, torch.tensor(blocks, dtype=torch.long, device=dev),
                            (k_pos <= q_pos).to(dev))

    # -- per layer --------------------------------------------------------------------------
    def forward_mla(self, layer_idx: int, q_nope: torch.Tensor, q_rope: torch.Tensor,
                    c: torch.Tensor, proj: MLAProjections, meta: AttentionMetadata,
                    state: _StepState) -> torch.Tensor:
        (cache,) = self.kv_caches[layer_idx]
        cache.view(-1, self.width).index_copy_(0, meta.slot_mapping.to(cache.device), c)
        t, h = q_nope.shape[:2]
        out = q_nope.new_empty((t, h, proj.w_uv.shape[1]))
        for plan in state.prefills:
            rows = slice(plan.seq.start, plan.seq.start + plan.seq.query_len)
            context = c[rows] if plan.gather_index is None else \
                cache.index_select(0, plan.gather_index).view(-1, self.width)
            out[rows] = self._decompressed(q_nope[rows], q_rope[rows], context, proj, plan.mask)
        if state.decode_table is not None:
            start = meta.num_prefill_tokens
            out[start:] = self._decode(q_nope[start:], q_rope[start:], cache, proj, state)
        return out

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                proj: MLAProjections, state: _StepState) -> torch.Tensor:
        """The decode tail: its sequences' blocks gathered into a reused scratch buffer (one
        index_select), then absorbed or decompressing attention."""
        index = state.decode_table.view(-1)
        ctx = torch.index_select(cache, 0, index, out=self._scratch[: index.numel()])
        ctx = ctx.view(q_nope.shape[0], -1, self.width)
        if self.decode_mode == "absorbed":
            return self.absorbed_decode(q_nope, q_rope, ctx, proj, state.decode_mask)
        return self.decompressed_decode(q_nope, q_rope, ctx, proj, state.decode_mask)

    def _decompressed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor,
                      proj: MLAProjections, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of n queries over ctx [L, width] (the query rows are its last n
        when `mask` is None), every key and value up-projected from the latents."""
        k, v = self.decompress(ctx, proj)  # [L, H, nope + rope], [L, H, v]
        q = torch.cat((q_nope, q_rope), dim=-1)
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)
        return o.squeeze(0).transpose(0, 1)

    def decompress(self, ctx: torch.Tensor, proj: MLAProjections
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [L, H, nope + rope] and values [L, H, v] from cache vectors [L, width]."""
        h, nope = proj.num_heads, proj.w_uk.shape[1]
        kv = F.linear(ctx[:, : self.rank], proj.kv_b_proj).view(ctx.shape[0], h, -1)
        k = torch.cat((kv[..., :nope],
                       ctx[:, None, self.rank:].expand(-1, h, self.rope_dim)), dim=-1)
        return k, kv[..., nope:]

    def absorbed_decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor,
                        proj: MLAProjections, mask: torch.Tensor) -> torch.Tensor:
        """n single-token queries over ctx [n, L, width] with the up-projections absorbed:
        two small per-head GEMMs around a multi-query attention over the cached vectors."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), proj.w_uk).transpose(0, 1)  # [n, H, rank]
        q = torch.cat((q_lat, q_rope), dim=-1)  # [n, H, width]
        if q.dtype != torch.float32:
            q, ctx = q.float(), ctx.float()
        scores = torch.baddbmm(mask, q, ctx.transpose(1, 2), alpha=self.scale)  # [n, H, L]
        probs = torch.softmax(scores, dim=-1)
        o_lat = torch.bmm(probs, ctx[..., : self.rank]).to(q_nope.dtype)  # [n, H, rank]
        return torch.bmm(o_lat.transpose(0, 1), proj.w_uv.transpose(1, 2)).transpose(0, 1)

    def decompressed_decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor,
                            proj: MLAProjections, mask: torch.Tensor) -> torch.Tensor:
        """The same decode, with every cached latent up-projected to per-head K/V each step."""
        n, length = ctx.shape[:2]
        k, v = self.decompress(ctx.reshape(n * length, self.width), proj)
        h = proj.num_heads
        kh = k.view(n, length, h, -1).transpose(1, 2)  # [n, H, L, nope + rope]
        vh = v.view(n, length, h, -1).transpose(1, 2)
        qh = torch.cat((q_nope, q_rope), dim=-1).unsqueeze(2)  # [n, H, 1, nope + rope]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None].to(qh.dtype),
                                           scale=self.scale)
        return o.squeeze(2)
