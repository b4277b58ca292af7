"""The CPU's linear methods (see `kvserve.layers.linear`): oneDNN on weights packed in its
blocked layout (`OneDNN`, `OneDNNGated`, with the gate's activation, the gated product and the
residual add as fused epilogues), and the C++ kernels of `kvserve.kernels.cpu`: the panel GEMM
(`Panel`) and the small-batch GEMV (`Gemv`), each wrapping a kernel bound to its weight.
Which of them a projection runs, per row bucket, is the GEMM plan's choice
(`kvserve.layers.gemm_select`), run by `cpu_methods.PlannedDecoder` / `PlannedHead`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.kernels.cpu import gemv
from kvserve.layers.linear import LinearMethod


def gemm_rows(t: int) -> int:
    """The row count a oneDNN GEMM of `t` rows runs with: `t` up to 16; else `t` rounded up to
    one of 8 sizes per doubling up to 256 rows (at most 12.5% padding) and of 16 sizes per
    doubling above (at most 6.25%).

    Why: oneDNN JIT-compiles a primitive for every distinct input shape and keeps it in two LRU
    caches of 1,024 entries each (its primitive cache and ideep's), at ~0.7 MB apiece on this
    project's CPU. A server's steps carry every token count from 1 to max_num_batched_tokens,
    so with exact shapes most steps compiled new kernels and RSS grew by ~12 MB per round of
    256 concurrent requests (see docs/soak.md). With these sizes there are 128 row counts up
    to 8,192 (5 GEMMs each, plus the LM head's up to max_num_seqs: under 700 primitives),
    which all stay cached. The finer steps above 256 rows are for prefill: 8 sizes per
    doubling padded a 2,112-token prompt to 2,304 rows and cost ~10% of its TTFT."""
    if t <= 16:
        return t
    shift = 4 if t <= 256 else 5
    step = 1 << max(t.bit_length() - shift, 0)
    return -(-t // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to gemm_rows(len(x)) (a copy), or x itself when that is
    its length: what a oneDNN GEMM runs on (slice its result back to len(x))."""
    t = x.shape[0]
    rows = gemm_rows(t)
    if rows == t:
        return x
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    out[:t].copy_(x)
    out[t:].zero_()
    return out


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(pad_rows(x), w, b, "none", [], "")[: x.shape[0]]


def onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor | None) -> torch.Tensor:
    t = x.shape[0]
    if gemm_rows(t) == t:  # in place into the residual stream
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, b, "add")
    return torch.ops.mkldnn._linear_pointwise.binary(
        pad_rows(x), pad_rows(residual), w, b, "add")[:t]


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    # The batch-size hint only picks the blocked layout; the packed weight serves any T.
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 64)


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this build and CPU can pack weights of `dtype` for oneDNN."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    # These are the (private) ops torch.compile's CPU freezing pass emits; probe them on a tiny
    # matrix rather than trusting their presence (e.g. bfloat16 needs avx512_bf16 or AMX).
    try:
        w = onednn_pack(torch.ones(8, 8, dtype=dtype))
        y = onednn_linear_add(torch.ones(2, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype), w,
                              None)
        return bool((y == 9).all())
    except Exception:  # noqa: BLE001 - any failure means "use F.linear"
        return False


def gemv_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ GEMV kernel (kernels/cpu/gemv.py) can run this model's projections."""
    return device.type == "cpu" and dtype == torch.float32 and gemv.load() is not None


class OneDNN(LinearMethod):
    """oneDNN on a weight packed by `onednn_pack`; rows rounded up by `gemm_rows` (a bounded
    set of compiled kernels), the residual add as the "add" post-op."""

    __slots__ = ("weight", "bias")

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = packed, bias

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return onednn_linear_add(x, residual, self.weight, self.bias)


class OneDNNGated(LinearMethod):
    """The gate | up projection on oneDNN, gate and up packed apart: the gate's activation
    (SiLU, or Gemma's GELU-tanh: oneDNN's "gelu" with the "tanh" algorithm) runs as the gate
    GEMM's epilogue and the product as the up GEMM's, which saves two passes over the
    [T, intermediate] activations (the SwiGLU element-wise work was ~12% of a decode step)."""

    __slots__ = ("gate_w", "up_w", "gate_b", "up_b", "act", "algorithm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, intermediate: int,
                 gelu: bool) -> None:
        i = intermediate
        self.gate_w = onednn_pack(weight[:i])
        self.up_w = onednn_pack(weight[i:])
        self.gate_b = None if bias is None else bias[:i].contiguous()
        self.up_b = None if bias is None else bias[i:].contiguous()
        self.act, self.algorithm = ("gelu", "tanh") if gelu else ("swish", "")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = pad_rows(x)  # a few cached GEMM shapes, not one per token count
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate_w, self.gate_b, self.act, [],
                                                  self.algorithm)
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up_w, self.up_b,
                                                         "mul")[:t]


class BoundKernel(LinearMethod):
    """A C++ kernel bound to its weight once (one pointer per call): `bound(x)` computes the
    projection, `bound(x, residual)` adds it into the residual stream in its epilogue."""

    __slots__ = ("bound",)

    def __init__(self, bound: Callable[..., torch.Tensor]) -> None:
        self.bound = bound

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound(x)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.bound(x, residual)


class Panel(BoundKernel):
    """kvserve's panel GEMM (kernels/cpu/panel_gemm.py) bound to its packed weight, with the
    bias (and a norm before, a gated activation after, where bound so) in the kernel's call;
    apply_add: the residual add in its epilogue."""

    __slots__ = ()


class Gemv(BoundKernel):
    """The C++ GEMV (kernels/cpu/gemv.py, up to gemv.MAX_ROWS rows) bound to its row-major
    weight; apply_add needs a binding in gemv.MODE_ADD (the add into the residual stream in
    the kernel)."""

    __slots__ = ()
