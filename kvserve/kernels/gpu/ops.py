"""Fused element-wise Triton kernels for the decoder on the GPU: RMSNorm, RoPE, SiLU-and-mul.

Why: a decode step at small batch is a chain of tiny kernels. In PyTorch, RMSNorm is eight of
them (norm, square, divide, add, rsqrt, multiply, cast, scale), RoPE four, SwiGLU's activation
two; a 28-layer model then launches ~800 kernels per step, and even replayed from a CUDA graph
each costs a couple of microseconds, which at batch 1 is a large slice of a step that should
take as long as reading the weights once. Fused, a layer's element-wise work is four kernels.

Numerics follow the PyTorch path in `kvserve.models.decoder` (Hugging Face's order): RMSNorm
statistics in float32, the normalised value cast to the model dtype before the weight is
applied; SiLU rounded to the model dtype before the product. RoPE is computed in float32 and
rounded once (PyTorch rounds the two products separately), a difference of at most one unit in
the last place of 16-bit outputs.

Like the attention kernels these run on CPU tensors under TRITON_INTERPRET=1, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import interpreter as _interpreter  # noqa: F401 - the NumPy 2 fix


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_xh, stride_wh, stride_ot,
                     stride_oh, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + offs, mask=mask,
                other=0.0)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * inv).to(x.dtype)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + h * stride_wh + offs, mask=mask, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [T, D] or [T, heads, D] (any leading strides, D contiguous); weight [D] or [heads, D]
    (per head, as Qwen3's fused q/k norm) or None. Returns a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        t, heads, d = x.shape[0], 1, x.shape[1]
        sxt, sxh = x.stride(0), 0
    elif x.dim() == 3:
        t, heads, d = x.shape
        sxt, sxh = x.stride(0), x.stride(1)
    else:
        raise ValueError(f"rms_norm expects a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    swh = 0 if weight is None or weight.dim() == 1 else weight.stride(0)
    soh = 0 if out.dim() == 2 else out.stride(1)
    _rms_norm_kernel[(t, heads)](
        x, weight if weight is not None else x, out, sxt, sxh, swh, out.stride(0), soh, eps,
        N=d, BLOCK=triton.next_power_of_2(d), HAS_WEIGHT=weight is not None)
    return out


@triton.jit
def _rope_kernel(x_ptr, cs_ptr, out_ptr, stride_xt, stride_xh, stride_cs, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh
    x1 = tl.load(row + offs, mask=mask, other=0.0)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0)
    cos = tl.load(cs_ptr + t.to(tl.int64) * stride_cs + offs, mask=mask, other=0.0)
    sin = tl.load(cs_ptr + t.to(tl.int64) * stride_cs + HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    c, s = cos.to(tl.float32), sin.to(tl.float32)
    dst = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    tl.store(dst + offs, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(dst + HALF + offs, (b * c + a * s).to(x1.dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos_sin [T, D] (cos | sin halves, rotate-half convention);
    returns a new contiguous tensor."""
    t, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if cos_sin.stride(1) != 1:
        cos_sin = cos_sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    half = d // 2
    _rope_kernel[(t, heads)](x, cos_sin, out, x.stride(0), x.stride(1), cos_sin.stride(0),
                             out.stride(0), out.stride(1), HALF=half,
                             BLOCK=triton.next_power_of_2(half))
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, N: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = x_ptr + t.to(tl.int64) * stride_xt
    g = tl.load(row + offs, mask=mask, other=0.0)
    u = tl.load(row + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, y, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] ([gate | up]) -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                 out.stride(0), N=n, BLOCK=block)
    return out
