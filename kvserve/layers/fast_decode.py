"""The one-call decode step: a decode step of up to gemv.MAX_ROWS sequences on the CPU as one
C++ call for all decoder layers (gemv.cpp's kvserve_decode_layers). A method of the model's
forward, not a second model: `cpu_methods.FastDecodeStep` (`CausalLM.decode_step`) makes it
where the measured GEMM plan runs every projection of the first row
bucket on the GEMV (its ops are the very bound kernels the layer-by-layer path calls), and
the forward offers it each step; tests/test_cpu_decode.py checks it against that path.

Why: at batch 1 a layer is three C++ calls (the qkv GEMV with its norm and RoPE, the paged
decode kernel, the MLP block), and the Python between them (views, the attention backend's
dispatch, argument packing) was ~10% of the step, the gap that kept kvserve behind llama.cpp.
Here the Python runs once per step: the attention backend hands out each layer's prepared
kernel arguments (`BoundAttention.kernel_args`, pointing at fixed q/k/v and output buffers),
and one call runs every layer.

Used only where it computes exactly what the layer-by-layer path computes: a float32 model
whose every projection runs the GEMV at this many rows, with RoPE fused (no q/k norms), no
Gemma output norms, and an attention backend that has kernel arguments for every layer of
the step (a float cache of the model's dtype, decode rows only); otherwise `run` returns
None and the forward takes the layer-by-layer path.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.attention.base import BoundAttention
from kvserve.kernels.cpu import gemv
from kvserve.layers.buckets import BUCKETS


def paged_kernel_args(attn: BoundAttention, n_layers: int, qkv: torch.Tensor,
                      out: torch.Tensor, heads: int, kv_heads: int, head_dim: int
                      ) -> tuple[int, list] | None:
    """(the paged kernel's C entry point, each layer's prepared arguments) for a one-call
    step whose q/k/v are the columns of the fixed `qkv` rows and whose attention output is
    `out` [rows, heads * head_dim]; None where a layer has none or the layers' kernels
    differ (one kernel runs every layer's arguments)."""
    rows, d = qkv.shape[0], head_dim
    q = qkv[:, : heads * d].view(rows, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(rows, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
    o = out.view(rows, heads, d)
    args, functions = [], set()
    for i in range(n_layers):
        a = attn.kernel_args(i, q, k, v, o)
        if a is None:
            return None
        functions.add(a[0])
        args.append(a[1])
    return (functions.pop(), args) if len(functions) == 1 else None


class FastDecode:
    """Fixed scratch (qkv rows and attention output for MAX_ROWS rows) shared by the layers,
    and the layers' bound GEMV ops (`cpu_methods.PlannedDecoder.one_call_ops`)."""

    def __init__(self, ops: list[tuple[gemv.BoundGemv, gemv.BoundMLPBlock]], heads: int,
                 kv_heads: int, head_dim: int) -> None:
        self._ops = ops
        self._heads, self._kv_heads, self._d = heads, kv_heads, head_dim
        width = (heads + 2 * kv_heads) * head_dim
        self._qkv = torch.empty(gemv.MAX_ROWS, width, dtype=torch.float32)
        self._out = torch.empty(gemv.MAX_ROWS, heads * head_dim, dtype=torch.float32)
        self._fn = gemv.load().decode_layers
        # the GEMV runs the first row bucket only (the plan's ops beyond it are others)
        self.max_rows = min(gemv.MAX_ROWS, int(BUCKETS[0][0]))
        n = len(ops)
        self._qkv_args = (ctypes.c_void_p * n)()
        self._mlp_args = (ctypes.c_void_p * n)()

    def run(self, hidden: torch.Tensor, cos_sin: torch.Tensor, attn: object
            ) -> torch.Tensor | None:
        """hidden [rows, hidden] (the residual stream, updated in place) through every layer;
        None (nothing run) where the step is not one this path serves."""
        rows = hidden.shape[0]
        if not isinstance(attn, BoundAttention) or rows > self.max_rows \
                or hidden.dtype != torch.float32 or hidden.stride(1) != 1 \
                or cos_sin.dtype != torch.float32 or cos_sin.stride(1) != 1:
            return None
        found = paged_kernel_args(attn, len(self._ops), self._qkv[:rows], self._out[:rows],
                                  self._heads, self._kv_heads, self._d)
        if found is None:
            return None
        function, kernel_args = found
        # Every step: the MLP block's argument array is shared with the layer path, whose
        # calls leave their own o pointer in it.
        threads = torch.get_num_threads()
        for i, (qkv_op, block) in enumerate(self._ops):
            self._qkv_args[i] = qkv_op.args_address(self._qkv, threads)
            self._mlp_args[i] = block.args_address(self._out, threads)
        paged = (ctypes.c_void_p * len(kernel_args))(*[ctypes.addressof(a)
                                                       for a in kernel_args])
        args = (ctypes.c_int64 * 10)(
            len(self._ops), rows, hidden.data_ptr(), hidden.stride(0), cos_sin.data_ptr(),
            cos_sin.stride(0), ctypes.addressof(self._qkv_args), ctypes.addressof(paged),
            ctypes.addressof(self._mlp_args), function)
        rc = self._fn(ctypes.addressof(args))
        if rc != 0:
            raise RuntimeError(f"kvserve_decode_layers failed ({rc}): a kernel refused its "
                               "arguments")
        return hidden

