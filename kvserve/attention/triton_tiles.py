"""The pieces the paged Triton kernels are built from, in one place so that each is written once.

Reading a tile of K or V through a block table (`paged_slots`, `load_kv`, which dequantizes fp8
and int8 tiles as it loads them), folding scores into flash attention's online softmax
(`online_softmax_step`), and the whole loop over a sequence's KV that the decode and extend
kernels share (`attend_paged`; the MLA kernel, whose keys and values are one latent tile, runs
its own loop on the same steps). Importing it applies the fix Triton 3.6's interpreter needs
under NumPy 2 (kvserve/kernels/gpu/interpreter.py), which is how they are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import interpreter as _interpreter  # noqa: F401 (applies the fix)

LOG2E = 1.4426950408889634  # the kernels' softmax is in base 2: scores are scaled by this


def on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def ieee(t: torch.Tensor) -> bool:
    """Whether tiles go through tl.dot in exact float32: for float32 models (no TF32 rounding, so
    results match the PyTorch path), and always under the interpreter, whose dot mishandles
    16-bit floats (it multiplies their raw bits)."""
    return t.dtype == torch.float32 or not on_gpu(t)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def paged_slots(table, pos, n_mask, BLOCK_SIZE: tl.constexpr):
    """(block id, offset in block) of each token position, through a sequence's block table."""
    blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return blk, pos % BLOCK_SIZE


@triton.jit
def _load_paged(cache, blk, tok, kvh, offs_d, mask, stride_b, stride_s, stride_h):
    """One KV head's [BLOCK_N, BLOCK_D] tile of K or V from scattered cache slots."""
    return tl.load(cache + blk[:, None] * stride_b + tok[:, None] * stride_s + kvh * stride_h
                   + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def fp8_bits_to_f32(b, FP8_EXP: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    """fp8 bytes (as stored: e4m3fn or e5m2, never NaN/inf, the codec saturates) -> float32,
    from the bits: exact, and the same code under the interpreter and on a GPU."""
    b = b.to(tl.int32)
    e = (b >> FP8_MANT) & ((1 << FP8_EXP) - 1)
    m = b & ((1 << FP8_MANT) - 1)
    # normal: (2^M + m) * 2^(e - bias - M); subnormal (e = 0): m * 2^(1 - bias - M)
    mant = tl.where(e == 0, m, m + (1 << FP8_MANT)).to(tl.float32)
    mag = mant * tl.math.exp2((tl.maximum(e, 1) - FP8_BIAS - FP8_MANT).to(tl.float32))
    return tl.where((b >> 7) != 0, -mag, mag)


@triton.jit
def load_kv(cache, sz, blk, tok, kvh, offs_d, mask, stride_b, stride_s, stride_h,
            sz_b, sz_s, sz_h, scale, KV_KIND: tl.constexpr, FP8_EXP: tl.constexpr,
            FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, GROUP_DIM: tl.constexpr):
    """One KV head's [BLOCK_N, BLOCK_D] tile, dequantized (float32) if the cache is quantized:
    only the tiles attention reads are ever dequantized."""
    x = _load_paged(cache, blk, tok, kvh, offs_d, mask, stride_b, stride_s, stride_h)
    if KV_KIND == 0:
        return x
    elif KV_KIND == 3:
        at = sz + blk[:, None] * sz_b + tok[:, None] * sz_s + kvh * sz_h \
            + (offs_d // GROUP_DIM)[None, :] * 2
        s = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
        return x.to(tl.float32) * s + z
    else:
        return fp8_bits_to_f32(x, FP8_EXP, FP8_MANT, FP8_BIAS) * scale


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one tile of (masked, log2-scaled) scores and its V rows into the running max,
    normaliser and output (flash attention's online softmax)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def attend_paged(q, q_pos, lo, end, window, qk_scale, table, kvh, k_cache, v_cache,
                 stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                 k_sz, v_sz, ksz_b, ksz_s, ksz_h, vsz_b, vsz_s, vsz_h, k_scale, v_scale,
                 ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr, KV_KIND: tl.constexpr, FP8_EXP: tl.constexpr,
                 FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, GROUP_DIM: tl.constexpr):
    """Attention of ROWS query rows `q` over positions [lo, end) of one KV head's paged cache:
    the running (max, normaliser, output) of the online softmax, for the caller to finish.
    With CAUSAL each row at `q_pos` sees keys q_pos - window < k <= q_pos (extend); without,
    every row sees the whole range (decode: one query, its window already in `lo`)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk, tok = paged_slots(table, pos, n_mask, BLOCK_SIZE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv(k_cache, k_sz, blk, tok, kvh, offs_d, kv_mask, stride_kcb, stride_kcs,
                    stride_kch, ksz_b, ksz_s, ksz_h, k_scale, KV_KIND, FP8_EXP, FP8_MANT,
                    FP8_BIAS, GROUP_DIM).to(q.dtype)
        s = dot(q, tl.trans(k), IEEE)
        if CAUSAL:
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) \
                & (pos[None, :] > q_pos[:, None] - window)
        else:
            visible = n_mask[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        v = load_kv(v_cache, v_sz, blk, tok, kvh, offs_d, kv_mask, stride_vcb, stride_vcs,
                    stride_vch, vsz_b, vsz_s, vsz_h, v_scale, KV_KIND, FP8_EXP, FP8_MANT,
                    FP8_BIAS, GROUP_DIM).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc
