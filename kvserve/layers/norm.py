"""RMSNorm as Hugging Face computes it (`rms_norm`), the one norm every architecture here uses;
the CPU's C++ norm (kvserve.kernels.cpu.gemv) and the GPU's Triton one
(kvserve.kernels.gpu.ops) compute the same; the plan's `MethodSource` says which one a model
runs."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm over the last dim: statistics in float32, result cast back to
    x's dtype, then scaled by `weight`.

    One fused reduction (`vector_norm`, float32 accumulation) plus two elementwise passes: on the
    CPU this is 2x faster than `F.rms_norm`, whose decomposition makes several passes."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv_rms = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()  # [..., 1], tiny
    y = torch.mul(x, inv_rms)  # float32 (type promotion)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if weight is None else y.mul_(weight)


def pre_norm(norm, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """norm(x) before attention or the MLP; x itself where the model has no such norm."""
    return x if weight is None else norm(x, weight, eps)
