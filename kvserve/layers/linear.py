"""Linear layers as method objects: a projection's weight (and bias) stay the model's
parameters, and *how* y = x W^T + b is computed is a `LinearMethod` bound to them.

`apply(x)` -> x W^T + b; `apply_add(x, residual)` -> residual + x W^T + b, in place into the
residual stream where the kernel can (the model folds its residual adds into the o and down
projections). The gate | up projection's methods compute the gated activation too
(`apply(x)` -> act(x Wg^T + bg) * (x Wu^T + bu)), since several kernels fuse it as an
epilogue. Here are the kernel-free methods the model runs without a GEMM plan (`Dense`,
`DenseGated`) and the output-norm wrapper; the CPU's kernels (oneDNN, the panel GEMM, the
GEMV) are methods in `kvserve.layers.cpu_linear`, which a layer's `PlannedDecoder` runs as
the measured GEMM plan says. A new kind of kernel (e.g. a quantized GEMM) is a new method
here or beside it; the model code does not change."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.layers.activation import gated
from kvserve.layers.norm import rms_norm


class LinearMethod:
    """How one projection runs (see the module docstring)."""

    __slots__ = ()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Dense(LinearMethod):
    """F.linear / addmm_ on the row-major weight (MKL for float32 on the CPU)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual.addmm_(x, self.weight.t())  # beta=1 GEMM straight into the residual stream
        return residual if self.bias is None else residual.add_(self.bias)


class DenseGated(LinearMethod):
    """The gate | up projection on its row-major [2i, k] weight, then act(gate) * up (SiLU, or
    Gemma's GELU-tanh); `act` replaces that element-wise step ([T, 2i] -> [T, i], e.g. the GPU's
    fused Triton kernel)."""

    __slots__ = ("weight", "bias", "intermediate", "gelu", "act")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, intermediate: int,
                 gelu: bool, act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.intermediate, self.gelu, self.act = intermediate, gelu, act

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.weight, self.bias)
        if self.act is not None:
            return self.act(gate_up)
        return gated(gate_up, self.intermediate, self.gelu)


class OutputNormed(LinearMethod):
    """A projection whose output is normed before its residual add (Gemma 3's and OLMo 2's
    output norms): apply_add(x, r) = r + norm(inner.apply(x)), GEMM, then norm, then add (the
    add cannot be fused into the GEMM)."""

    __slots__ = ("inner", "weight", "eps", "norm")

    def __init__(self, inner: LinearMethod, weight: torch.Tensor, eps: float,
                 norm: Callable = rms_norm) -> None:
        self.inner, self.weight, self.eps, self.norm = inner, weight, eps, norm

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(x)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual.add_(self.norm(self.inner.apply(x), self.weight, self.eps))


def with_output_norm(method: LinearMethod, out_norm: torch.Tensor | None, eps: float,
                     norm: Callable = rms_norm) -> LinearMethod:
    """`method`, or (with an output norm) `method` wrapped in OutputNormed."""
    return method if out_norm is None else OutputNormed(method, out_norm, eps, norm)
