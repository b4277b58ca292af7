"""Triton kernels for the paged KV cache, with thin PyTorch launchers.

Four kernels, all addressing the cache through block tables so that a sequence's KV never has to
be contiguous:

* `store_kv`: write the K/V of this step's new tokens into their cache slots (slot < 0 = a
  padding row of a CUDA-graph batch, skipped).
* `decode_attention`: one query token per sequence over its cached KV, flash-decoding style.
  Each program owns one (sequence, KV head, split): it loads a K/V tile once for all query heads
  of its GQA group (MQA is the group = all heads), so KV is read once per step, and the KV range
  is split across programs so that a batch of one still fills the GPU; a second small kernel
  merges the splits by their log-sum-exp.
* `extend_attention`: the new tokens of many sequences of different lengths in one launch, each
  attending causally to its cached prefix plus itself. New K/V are stored first, so prefix and
  new tokens are read by the same paged loop (one code path for a cold prefill, a chunk, and an
  extension of a cached prefix).
* Sliding windows: both attention kernels take `window` (W: a query at position q sees keys
  q - W < k <= q, transformers' rule; `NO_WINDOW` for full attention) and start their loops at
  the first visible key, so a windowed layer reads about W tokens of KV and no block before its
  window.
* `copy_blocks`: copy whole blocks (src -> dst) in every layer's K and V in one launch, through a
  table of the per-layer cache pointers (copy-on-write of a shared partial block).

The cache layout is the engine's: per layer `k, v` of shape [num_blocks, block_size, Hkv, D].
A quantized cache (kv/quant.py; `QuantKV` says which) is read by the attention kernels and
dequantized tile by tile as it is loaded: fp8 (e4m3 or e5m2 bytes, one scale per tensor) decoded
from its bits, int8 as code x scale + zero with the fp16 scale/zero of each token, head and
group. New K/V are quantized into such a cache by the pool's codec (PyTorch ops), not
`store_kv`; int4 (KIVI) is not read here.
Any block size works (slots are addressed per token); head_dim may be any size from 16 to 256
(tiles are padded to a power of two and masked). The kernels also run on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how they are tested without a GPU. The
two attention kernels differ only in which queries and keys a program takes: the paged loop
over the keys is one function of triton_tiles.py, so a change to it reaches both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.triton_tiles import LOG2E, attend_paged, ieee, on_gpu

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MIN_HEAD_DIM = 16  # tl.dot needs an inner dimension of at least 16
NO_WINDOW = 1 << 30  # the `window` of a full-attention layer: larger than any context


def window_arg(window: int | None) -> int:
    """A layer's window as the kernels take it."""
    return NO_WINDOW if window is None else window


# QuantKV.kind: how the kernels read a cache tile.
KV_PLAIN, KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8 = 0, 1, 2, 3
_FP8_BITS = {KV_FP8_E4M3: (4, 3, 7), KV_FP8_E5M2: (5, 2, 15)}  # exponent, mantissa, bias


@dataclass
class QuantKV:
    """A quantized layer cache as the kernels read it: fp8 bytes with a per-tensor scale
    (`k_scale`, `v_scale`), or int8 codes with fp16 (scale, zero) per token, head and group of
    `group_dim` channels in `k_sz`/`v_sz` [num_blocks, block_size, Hkv, groups, 2]."""

    kind: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_sz: torch.Tensor | None = None
    v_sz: torch.Tensor | None = None
    group_dim: int = 1 << 30

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        """Positional kernel arguments: the scale tensors (the caches themselves as stand-ins
        when there are none) and their strides, then the two scales."""
        k_sz = self.k_sz if self.k_sz is not None else k_cache
        v_sz = self.v_sz if self.v_sz is not None else v_cache
        return (k_sz, v_sz, k_sz.stride(0), k_sz.stride(1), k_sz.stride(2),
                v_sz.stride(0), v_sz.stride(1), v_sz.stride(2), self.k_scale, self.v_scale)

    def constexprs(self) -> dict:
        exp, mant, bias = _FP8_BITS.get(self.kind, (4, 3, 7))
        return {"KV_KIND": self.kind, "FP8_EXP": exp, "FP8_MANT": mant, "FP8_BIAS": bias,
                "GROUP_DIM": min(self.group_dim, 1 << 30)}


PLAIN = QuantKV(KV_PLAIN)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   quant: QuantKV = PLAIN) -> None:
    """Raise ValueError unless the cache is something these kernels handle."""
    if quant.kind != KV_PLAIN:
        if k_cache.dtype != torch.uint8:
            raise ValueError(f"a quantized KV cache holds bytes (uint8), got {k_cache.dtype}")
    elif k_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Triton attention supports {[str(d) for d in SUPPORTED_DTYPES]} KV "
                         f"caches, got {k_cache.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("KV cache tensors must both be [num_blocks, block_size, kv_heads, "
                         f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    d = k_cache.shape[3]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"Triton attention supports head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, "
                         f"got {d}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("KV cache tensors must be contiguous in head_dim")


def _block_d(head_dim: int) -> int:
    return max(MIN_HEAD_DIM, triton.next_power_of_2(head_dim))


def _launch_shapes(q: torch.Tensor, k_cache: torch.Tensor,
                   out: torch.Tensor | None) -> tuple[int, int, torch.Tensor]:
    """(block size, KV heads, output) of an attention launch, checked the same way for both
    kernels: every query head must map onto a KV head."""
    _, block_size, hkv, _ = k_cache.shape
    if q.shape[1] % hkv:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({hkv})")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return block_size, hkv, out


# ------------------------------------------------------------------------------------------------
# (a) store K/V into cache slots
# ------------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch,
                     stride_vcb, stride_vcs, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = k_cache + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch \
        + offs_d[None, :]
    dst_v = v_cache + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch \
        + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (any row/head strides, D contiguous) -> their slots in the cache.

    slot_mapping [T] int64: block * block_size + offset; negative entries are skipped."""
    t = k.shape[0]
    if t == 0:
        return
    _, block_size, hkv, d = k_cache.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("new K/V must be contiguous in head_dim")
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=block_size)


# ------------------------------------------------------------------------------------------------
# (b) paged decode attention, split-K
# ------------------------------------------------------------------------------------------------
# Arguments that change from step to step (block-table width, split count) are not specialised:
# a new value must not compile a new kernel in the middle of serving.
@triton.jit(do_not_specialize=["stride_tb", "stride_mob", "stride_moh", "stride_mlb",
                               "stride_mlh", "window"])
def _decode_split_kernel(q_ptr, k_cache, v_cache, tables, seq_lens, mid_o, mid_lse,
                         qk_scale, window,
                         stride_qt, stride_qh,
                         stride_kcb, stride_kcs, stride_kch,
                         stride_vcb, stride_vcs, stride_vch,
                         stride_tb,
                         stride_mob, stride_moh, stride_mos,
                         stride_mlb, stride_mlh,
                         k_sz, v_sz, ksz_b, ksz_s, ksz_h, vsz_b, vsz_s, vsz_h,
                         k_scale, v_scale,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         IEEE: tl.constexpr, KV_KIND: tl.constexpr, FP8_EXP: tl.constexpr,
                         FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
                         GROUP_DIM: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)  # int32 or int64 buffers: one loop type
    lo = tl.maximum(seq_len - window, 0)  # the first key inside the window
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i, l_i, acc = attend_paged(
        q, 0, start, end, window, qk_scale, tables + b * stride_tb, kvh, k_cache, v_cache,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, k_sz, v_sz,
        ksz_b, ksz_s, ksz_h, vsz_b, vsz_s, vsz_h, k_scale, v_scale, BLOCK_G, HEAD_DIM, BLOCK_D,
        BLOCK_N, BLOCK_SIZE, False, IEEE, KV_KIND, FP8_EXP, FP8_MANT, FP8_BIAS, GROUP_DIM)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # base 2
    o_ptrs = mid_o + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos \
        + offs_d[None, :]
    tl.store(o_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["stride_mob", "stride_moh", "stride_mlb", "stride_mlh",
                               "stride_ot"])
def _decode_merge_kernel(mid_o, mid_lse, out_ptr,
                         stride_mob, stride_moh, stride_mos,
                         stride_mlb, stride_mlh,
                         stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row with no KV at all: output 0
    w = tl.where(s_mask, tl.math.exp2(lse - m), 0.0)
    o = tl.load(mid_o + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos
                + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int = 64,
                  num_sms: int | None = None) -> int:
    """How many programs share one sequence's KV: enough (batch x kv heads x splits) programs to
    cover the GPU about twice, never a split shorter than two tiles, at most 32 (the merge reads
    every split of every head). A power of two, so that at most six kernel variants exist."""
    if num_sms is None:
        num_sms = _num_sms()
    want = max(1, (2 * num_sms) // max(1, batch * num_kv_heads))
    by_len = max(1, max_seq_len // (2 * block_n))
    n = int(min(want, by_len, 32))
    return 1 << (n.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 4


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     max_seq_len: int | None = None, block_n: int = 64,
                     window: int | None = None, quant: QuantKV = PLAIN) -> torch.Tensor:
    """q [B, H, D] (one token per sequence) over the paged cache -> [B, H, D]; with `window`,
    over its last `window` keys only; `quant` says how a quantized cache is read.

    block_tables [B, max_blocks] int32, seq_lens [B] int32 (KV length including this token,
    already stored). `num_splits` fixes the split count (CUDA graphs need one per bucket); else
    it is chosen from `max_seq_len` (or seq_lens.max(), which syncs)."""
    b, h, d = q.shape
    block_size, hkv, out = _launch_shapes(q, k_cache, out)
    if b == 0:
        return out
    group = h // hkv
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = decode_splits(b, hkv, max_seq_len, block_n)
    mid_o = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    block_d = _block_d(d)
    gpu = on_gpu(q)
    _decode_split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        scale * LOG2E, window_arg(window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        *quant.args(k_cache, v_cache),
        GROUP=group, HEAD_DIM=d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        IEEE=ieee(q), **quant.constexprs(),
        **({"num_warps": 4, "num_stages": 2} if gpu else {}))
    _decode_merge_kernel[(b, h)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        **({"num_warps": 2} if gpu else {}))
    return out


# ------------------------------------------------------------------------------------------------
# (c) extend / prefill attention over a cached prefix plus the new tokens
# ------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_tb", "window"])
def _extend_kernel(q_ptr, k_cache, v_cache, out_ptr, tables, q_starts, q_lens, seq_lens,
                   qk_scale, window,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kcb, stride_kcs, stride_kch,
                   stride_vcb, stride_vcs, stride_vch,
                   stride_tb,
                   k_sz, v_sz, ksz_b, ksz_s, ksz_h, vsz_b, vsz_s, vsz_h,
                   k_scale, v_scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   IEEE: tl.constexpr, KV_KIND: tl.constexpr, FP8_EXP: tl.constexpr,
                   FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, GROUP_DIM: tl.constexpr):
    mb = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_lens + s).to(tl.int32)
    m0 = mb * BLOCK_M
    if m0 >= q_len:
        return
    q_start = tl.load(q_starts + s)
    seq_len = tl.load(seq_lens + s).to(tl.int32)
    ctx = seq_len - q_len  # cached prefix length
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)  # the last row sees up to its own position
    lo = tl.maximum(ctx + m0 - window + 1, 0)  # the first row's first visible key
    # Each row at its absolute position ctx + offs_m, causally within its window.
    m_i, l_i, acc = attend_paged(
        q, ctx + offs_m, lo, end, window, qk_scale, tables + s * stride_tb, kvh, k_cache,
        v_cache, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, k_sz,
        v_sz, ksz_b, ksz_s, ksz_h, vsz_b, vsz_s, vsz_h, k_scale, v_scale, BLOCK_M, HEAD_DIM,
        BLOCK_D, BLOCK_N, BLOCK_SIZE, True, IEEE, KV_KIND, FP8_EXP, FP8_MANT, FP8_BIAS,
        GROUP_DIM)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                     seq_lens: torch.Tensor, max_query_len: int, scale: float,
                     out: torch.Tensor | None = None, window: int | None = None,
                     quant: QuantKV = PLAIN) -> torch.Tensor:
    """Prefill/extend attention for S sequences in one launch.

    q [T, H, D] holds every sequence's new tokens (rows q_starts[i] .. + q_lens[i]); their K/V
    are already in the cache. Sequence i attends to its first seq_lens[i] - q_lens[i] cached
    tokens plus its new ones, causally (with `window`, only the last `window` positions up to
    each query's own). block_tables [S, max_blocks] int32; the other per-
    sequence tensors [S] int32. Rows of q not covered by any sequence are left untouched."""
    t, h, d = q.shape
    block_size, hkv, out = _launch_shapes(q, k_cache, out)
    num_seqs = q_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    gpu = on_gpu(q)
    block_d = _block_d(d)
    if gpu:
        block_m = 64 if block_d <= 128 else 32
        block_n = 64 if q.dtype != torch.float32 else 32
        launch = {"num_warps": 4, "num_stages": 2}
    else:
        block_m, block_n, launch = 16, 16, {}
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, h)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, seq_lens,
        scale * LOG2E, window_arg(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *quant.args(k_cache, v_cache),
        GROUP=h // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, IEEE=ieee(q), **quant.constexprs(), **launch)
    return out


# ------------------------------------------------------------------------------------------------
# (d) copy blocks in every layer
# ------------------------------------------------------------------------------------------------
@triton.jit
def _copy_blocks_kernel(cache_ptrs, src_ptr, dst_ptr, BLOCK_NUMEL: tl.constexpr,
                        CHUNK: tl.constexpr, ELEM_BITS: tl.constexpr):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    raw = tl.load(cache_ptrs + cache)
    if ELEM_BITS == 32:
        base = raw.to(tl.pointer_type(tl.int32))
    elif ELEM_BITS == 16:
        base = raw.to(tl.pointer_type(tl.int16))
    else:
        base = raw.to(tl.pointer_type(tl.int8))
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(base + dst * BLOCK_NUMEL + offs, x, mask=mask)


def cache_pointer_table(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[2 * layers] int64 data pointers of every K and V cache tensor (on their device)."""
    ptrs = [t.data_ptr() for pair in kv_caches for t in pair]
    return torch.tensor(ptrs, dtype=torch.int64, device=kv_caches[0][0].device)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor,
                dst: torch.Tensor, pointer_table: torch.Tensor | None = None) -> None:
    """Copy block src[i] onto block dst[i] in every layer's K and V, in one launch.

    src, dst [N] int64 on the cache's device. Every cache tensor must be contiguous with the
    same shape and dtype (the engine allocates them so)."""
    n = src.shape[0]
    if n == 0:
        return
    k0 = kv_caches[0][0]
    for pair in kv_caches:
        for t in pair:
            if not t.is_contiguous() or t.shape != k0.shape or t.dtype != k0.dtype:
                raise ValueError("copy_blocks needs contiguous cache tensors of one shape/dtype")
    if pointer_table is None:
        pointer_table = cache_pointer_table(kv_caches)
    block_numel = k0[0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (n, 2 * len(kv_caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](pointer_table, src, dst, BLOCK_NUMEL=block_numel, CHUNK=chunk,
                              ELEM_BITS=8 * k0.element_size())
