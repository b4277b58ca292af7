"""A Triton decode kernel for MLA over the paged latent cache (absorbed form).

Each program owns one sequence and a tile of up to BLOCK_H query heads. Every head's absorbed
query is [W_UK^T q_nope | q_rope] (rank + rope values); keys are the cached vectors themselves and
values their latent part, so a tile of cache rows is loaded once and serves the scores and the
value sum of every head in the tile (multi-query attention with a wide head). The output is the
attention-weighted latent [B, H, rank]; the caller applies W_UV. Scores use the online softmax of
the paged kernels (`triton_tiles`), whose helpers this reuses; it also runs on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1), which is how it is tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton_tiles import (LOG2E, dot, ieee, on_gpu, online_softmax_step,
                                            paged_slots)

MIN_TILE = 16  # tl.dot's smallest inner dimension


@triton.jit(do_not_specialize=["stride_tb"])
def _mla_decode_kernel(q_ptr, cache, tables, seq_lens, out_ptr, qk_scale,
                       stride_qb, stride_qh, stride_cb, stride_cs, stride_tb,
                       stride_ob, stride_oh,
                       NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < NUM_HEADS
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :],
                   other=0.0)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = tables + b * stride_tb
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < seq_len
        blk, tok = paged_slots(table, pos, n_mask, BLOCK_SIZE)
        row = cache + blk[:, None] * stride_cb + tok[:, None] * stride_cs
        lat = tl.load(row + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        pe = tl.load(row + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :],
                     other=0.0)
        s = dot(q_lat, tl.trans(lat), IEEE) + dot(q_pe, tl.trans(pe), IEEE)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, lat, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, rank: int,
                         block_n: int = 32) -> torch.Tensor:
    """Absorbed queries q [B, H, rank + rope] (one token per sequence) over the latent cache
    [num_blocks, block_size, 1, rank + rope] -> attention-weighted latents [B, H, rank].

    block_tables [B, max_blocks] int32, seq_lens [B] (KV length including the new token, already
    stored)."""
    b, h, width = q.shape
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"latent cache {tuple(cache.shape)} does not fit queries of width "
                         f"{width}")
    if cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("the latent cache and queries must be contiguous in their last dim")
    out = torch.empty((b, h, rank), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    rope = width - rank
    block_h = max(MIN_TILE, min(64, triton.next_power_of_2(h)))
    _mla_decode_kernel[(b, triton.cdiv(h, block_h))](
        q, cache, block_tables, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=h, RANK=rank, ROPE=rope, BLOCK_H=block_h,
        BLOCK_R=max(MIN_TILE, triton.next_power_of_2(rank)),
        BLOCK_P=max(MIN_TILE, triton.next_power_of_2(max(rope, 1))),
        BLOCK_N=block_n, BLOCK_SIZE=cache.shape[1], IEEE=ieee(q),
        **({"num_warps": 4, "num_stages": 2} if on_gpu(q) else {}))
    return out
