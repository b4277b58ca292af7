"""The one-call decode step on quantized weights: a decode step of up to 4 rows through every
decoder layer in one C++ call (csrc/qdecode.cpp), made by `cpu_methods.QuantDecodeStep`
(`CausalLM.decode_step`) where every layer's four projections are blocks, as FastDecode is for
the float GEMV.

Why: at batch 1 the quantized layer-by-layer path makes ~120 kernel calls a step, and the
Python between them cost ~3 ms of an 11 ms step on SmolLM2 (AVX-512 EPYC), where llama.cpp's
whole step is 6.8 ms. Here Python runs once per step: it hands over each layer's prepared
argument arrays and the attention backend's kernel arguments.

It computes what the layer-by-layer path computes, bit for bit: the same kernels (qgemv's, the
C++ RMSNorm and RoPE the layer path binds, the paged decode kernel) in the same order on the
same rows (tests/test_quant_decode.py). Where a step is not one it serves (more rows than the
integer kernel's decode limit, an attention backend without kernel arguments: a quantized KV
cache, prefill rows, H2O) `run` returns None and the forward takes the layer path.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from kvserve.attention.base import BoundAttention
from kvserve.kernels.cpu import gemv, qdecode, qgemv
from kvserve.layers.fast_decode import paged_kernel_args
from kvserve.layers.block import PROJECTION_ATTRS
from kvserve.layers.kernel_choice import DECODE_ROWS, override
from kvserve.layers.quant_linear import QuantWeight, StackedBound, bind_weight

# The rows a step may have on row-tiled weights: the tile kernel wins at every row count
# (qtiles.h), so the layer path runs it too up to its measured crossover, and a batch-32 step
# saves the Python between ~120 kernel calls
TILED_ROWS = 64
# norm1, qkv args list, its length, paged args, o args, norm2, gate_up args, down args
_LAYER_FIELDS = 8


def cpp_rope(qk: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """layers.rotary.apply_rope's rotation of qk [T, heads, D] (heads and D contiguous) on
    gemv's C++ RoPE, in place: the rotation the one-call step makes, so the quantized layer
    path runs it too (`cpu_methods.QuantizedDecoder`) and both give the same bits."""
    t, heads, d = qk.shape
    gemv.load().rope_(qk.view(t, heads * d), cos_sin, heads * d, d)
    return qk


def _servable(model) -> bool:
    """Every layer a DecoderLayer with its four projections as blocks, pre-norms and no
    other norm around them (no q/k norm, no Gemma output norms), one eps and one RoPE."""
    layers = model.layers
    if not layers or len(set(model.rope_of_layer)) != 1:
        return False
    for layer in layers:
        quant = getattr(layer, "quant_weights", None) or {}
        if not hasattr(layer, "qkv_proj") or set(quant) != set(PROJECTION_ATTRS) \
                or not all(isinstance(quant[a], QuantWeight)
                           for a in ("o_proj", "gate_up_proj", "down_proj")) \
                or layer.qk_norm is not None or layer.attn_out_norm is not None \
                or layer.mlp_out_norm is not None or layer.input_layernorm is None \
                or layer.post_attention_layernorm is None or layer.eps != layers[0].eps \
                or layer.input_layernorm.dtype != torch.float32:
            return False
    return True


class QuantDecode:
    """Fixed scratch for DECODE_ROWS rows (the normed x, qkv, attention output, the MLP's
    activation), each layer's own bound qgemv ops (argument arrays of their own: the layer
    path's ops keep theirs) and its argument array for the C++ loop."""

    @classmethod
    def build(cls, model) -> "QuantDecode | None":
        kernel, q = qdecode.load(), qgemv.load()
        if kernel is None or q is None or not _servable(model):
            return None
        return cls(model, kernel)

    def __init__(self, model, kernel: qdecode.QDecode) -> None:
        first = model.layers[0]
        tiled = all(getattr(layer.quant_weights[a], "tiled", False)
                    for layer in model.layers for a in ("o_proj", "gate_up_proj", "down_proj"))
        rows = TILED_ROWS if tiled else DECODE_ROWS
        self._h, self._hkv, self._d = first.num_heads, first.num_kv_heads, first.head_dim
        self._hidden = first.input_layernorm.shape[0]
        self._x = torch.empty(rows, self._hidden, dtype=torch.float32)
        self._qkv = torch.empty(rows, (self._h + 2 * self._hkv) * self._d, dtype=torch.float32)
        self._out = torch.empty(rows, self._h * self._d, dtype=torch.float32)
        self._act = torch.empty(rows, first.intermediate_size, dtype=torch.float32)
        self._fn = kernel.decode_layers
        # the rows the layer path runs on the integer kernel (its methods read the same
        # override when they are built): beyond them it is F.linear on dequantized weights
        forced = override().rows
        self.max_rows = int(min(rows, forced if forced is not None else rows))
        self._ops: list[tuple] = []
        self._layer_args = []
        for layer in model.layers:
            w = layer.quant_weights
            gated = qgemv.MODE_GELU_MUL if layer.gelu else qgemv.MODE_SILU_MUL
            qkv = bind_weight(w["qkv_proj"], layer.qkv_proj.bias, qgemv.MODE_STORE)
            # (op, first column, end): a stacked qkv's parts, each into its columns
            qkv_ops = qkv.parts if isinstance(qkv, StackedBound) else [(qkv, 0, qkv.n)]
            ops = (qkv_ops, bind_weight(w["o_proj"], layer.o_proj.bias, qgemv.MODE_ADD),
                   bind_weight(w["gate_up_proj"], layer.gate_up_proj.bias, gated),
                   bind_weight(w["down_proj"], layer.down_proj.bias, qgemv.MODE_ADD))
            self._ops.append((ops, layer.input_layernorm, layer.post_attention_layernorm))
            self._layer_args.append((ctypes.c_int64 * _LAYER_FIELDS)())
        self._qkv_lists = [(ctypes.c_void_p * len(ops[0]))() for ops, _, _ in self._ops]
        self._layers = (ctypes.c_void_p * len(self._layer_args))(
            *[ctypes.addressof(a) for a in self._layer_args])
        self._qgemv_fn = self._ops[0][0][1].function_address
        self._eps_bits = struct.unpack("<i", struct.pack("<f", first.eps))[0]
        self._rope_cols = (self._h + self._hkv) * self._d
        self._threads = -1  # the argument arrays are filled for this many threads

    def _fill(self, threads: int) -> None:
        """Every layer's argument array (pointers that do not change from step to step)."""
        for args, qkv_list, ((qkv, o, gu, down), norm1, norm2) in zip(
                self._layer_args, self._qkv_lists, self._ops):
            for i, (op, c0, c1) in enumerate(qkv):
                qkv_list[i] = op.args_address(None, self._qkv[:, c0:c1], threads)
            args[0] = norm1.data_ptr()
            args[1], args[2] = ctypes.addressof(qkv_list), len(qkv)
            args[4] = o.args_address(self._out, None, threads)
            args[5] = norm2.data_ptr()
            args[6] = gu.args_address(None, self._act, threads)
            args[7] = down.args_address(self._act, None, threads)
        self._threads = threads

    def run(self, hidden: torch.Tensor, cos_sin: torch.Tensor, attn: object
            ) -> torch.Tensor | None:
        """hidden [rows, hidden] (the residual stream, updated in place) through every layer;
        None (nothing run) where the step is not one this path serves."""
        rows = hidden.shape[0]
        if not isinstance(attn, BoundAttention) or rows > self.max_rows or rows == 0 \
                or hidden.dtype != torch.float32 or hidden.stride(1) != 1 \
                or cos_sin.dtype != torch.float32 or cos_sin.stride(1) != 1 \
                or cos_sin.shape[1] != self._d:
            return None
        found = paged_kernel_args(attn, len(self._layer_args), self._qkv[:rows],
                                  self._out[:rows], self._h, self._hkv, self._d)
        if found is None:
            return None
        function, paged = found
        threads = torch.get_num_threads()
        if threads != self._threads:
            self._fill(threads)
        for args, a in zip(self._layer_args, paged):
            args[3] = ctypes.addressof(a)
        top = (ctypes.c_int64 * 14)(
            len(self._layer_args), rows, hidden.data_ptr(), hidden.stride(0), self._hidden,
            cos_sin.data_ptr(), cos_sin.stride(0), ctypes.addressof(self._layers),
            function, self._qgemv_fn, self._eps_bits, self._x.data_ptr(),
            self._rope_cols, self._d)
        rc = self._fn(ctypes.addressof(top))
        if rc != 0:
            layer, stage = divmod(rc - 1, 4)
            raise RuntimeError(f"kvserve_qdecode_layers failed at layer {layer} ("
                               f"{('qkv', 'attention', 'o', 'MLP')[stage]}): a kernel refused "
                               "its arguments")
        return hidden
