"""A DecoderLayer's projections on each CPU kernel, as `cpu_methods.PlannedDecoder` runs them
(and times them, for the GEMM plan): `kernel_ops(layer, kernel, projs, fused)` ->
projection -> callable, made from the kernel's linear methods (`kvserve.layers.cpu_linear`)
with the element-wise work around them.

Two shapes of ops: GEMM-level (the GEMMs alone, on normed x: the benchmarks' GEMM ceiling)
and layer-level (`LayerMethods`' callables: the norms before qkv and gate/up, the split and
RoPE after qkv). The GEMV and the panel GEMM fuse the norms (and the GEMV the RoPE) into
their own calls when `fused`; the other kernels' GEMM-level ops are wrapped into layer-level
ones (`wrap_unfused`), with the norm and RoPE as the C++ kernels of kernels/cpu/gemv.py in
float32 (torch ops elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.kernels.cpu import gemv, panel_gemm
from kvserve.layers.block import PROJECTIONS, split_qkv
from kvserve.layers.cpu_linear import Gemv, OneDNN, OneDNNGated, Panel, gemv_available, onednn_pack
from kvserve.layers.linear import Dense, DenseGated, with_output_norm
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope

# kernels whose fused ops (layer-level) take the norms before qkv and gate/up in their calls
FUSED_KERNELS = ("gemv", "panel")


def kernel_ops(layer, kernel: str, projs: tuple[str, ...] = PROJECTIONS,
               fused: bool = False) -> dict[str, Callable]:
    """`kernel`'s ops of `layer` (a DecoderLayer) for `projs` (packed copies made here), in
    the shape `fused` asks for where the kernel fuses (the GEMV, the panel GEMM)."""
    if kernel == "dense":
        return dense_ops(layer, projs)
    if kernel == "onednn":
        return onednn_ops(layer, projs)
    if kernel == "gemv":
        return gemv_ops(layer, projs, fused)
    if kernel == "panel":
        return panel_ops(layer, projs, fused)
    raise ValueError(f"unknown GEMM kernel {kernel!r}")


def attn_in_unfused(layer, qkv: Callable[[torch.Tensor], torch.Tensor]
                    ) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """(residual, cos_sin) -> q, k, v around a qkv GEMM on normed x: norm, GEMM, split, RoPE.
    In float32 on the CPU the norm is the C++ kernel of gemv.py rather than torch ops."""
    w, eps = layer.input_layernorm, layer.eps
    if w is None:  # no pre-norm: the GEMM reads the residual stream
        return attn_in_after_norm(layer, qkv)
    g = gemv.load() if gemv_available(w.dtype, w.device) else None
    norm = g.rms_norm if g is not None else rms_norm
    return attn_in_after_norm(layer, lambda h: qkv(norm(h, w, eps)))


def attn_in_after_norm(layer, qkv: Callable[[torch.Tensor], torch.Tensor]
                       ) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """(residual, cos_sin) -> q, k, v around `qkv` (residual -> q | k | v, normed inside):
    split, q/k norms, RoPE. In float32 on the CPU (without q/k norms) the RoPE is gemv.py's
    C++ kernel, in place on the GEMM's output."""
    w = layer.o_proj.weight
    g = gemv.load() if gemv_available(w.dtype, w.device) else None
    if g is None or layer.qk_norm is not None:  # q/k norms sit between projection and RoPE
        return lambda h, cos_sin: split_qkv(layer, qkv(h), cos_sin, rope=apply_rope)
    cols, d = layer.qk_size, layer.head_dim
    return lambda h, cos_sin: split_qkv(layer, g.rope_(qkv(h), cos_sin, cols, d), cos_sin)


def wrap_unfused(layer, kernel: str, ops: dict[str, Callable]) -> None:
    """Turn a GEMM-level ops dict of `kernel` into the layer's ops (see LayerMethods), in place:
    the GEMMs take normed x, the layer's ops the residual stream. The GEMV's and the panel
    GEMM's fused ops already are."""
    if kernel in FUSED_KERNELS:
        return
    if "qkv" in ops:
        ops["qkv"] = attn_in_unfused(layer, ops["qkv"])
    if "mlp" in ops and layer.post_attention_layernorm is not None:
        mlp, w, eps = ops["mlp"], layer.post_attention_layernorm, layer.eps
        g = gemv.load() if gemv_available(w.dtype, w.device) else None
        norm = g.rms_norm if g is not None else rms_norm
        ops["mlp"] = lambda x: mlp(norm(x, w, eps))


def dense_ops(layer, projs: tuple[str, ...] = PROJECTIONS) -> dict[str, Callable]:
    """F.linear / addmm_ on the row-major weights (MKL for float32), for `projs` only (a
    method keeps its weight alive)."""
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        ops["qkv"] = Dense(layer.qkv_proj.weight, layer.qkv_proj.bias).apply
    if "o" in projs:
        ops["o"] = with_output_norm(Dense(layer.o_proj.weight, layer.o_proj.bias),
            layer.attn_out_norm, layer.eps).apply_add
    if "mlp" in projs:
        ops["mlp"] = DenseGated(layer.gate_up_proj.weight, layer.gate_up_proj.bias,
                                layer.intermediate_size, layer.gelu).apply
    if "down" in projs:
        ops["down"] = with_output_norm(Dense(layer.down_proj.weight, layer.down_proj.bias),
                                       layer.mlp_out_norm, layer.eps).apply_add
    return ops


def onednn_ops(layer, projs: tuple[str, ...] = PROJECTIONS) -> dict[str, Callable]:
    """oneDNN on packed copies of the weights (made here), for `projs` only: the gate's
    activation and the product with up fused as GEMM epilogues (`OneDNNGated`), and the
    residual adds too where no output norm sits between GEMM and add."""
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        ops["qkv"] = OneDNN(onednn_pack(layer.qkv_proj.weight), layer.qkv_proj.bias).apply
    if "o" in projs:
        ops["o"] = with_output_norm(OneDNN(onednn_pack(layer.o_proj.weight), layer.o_proj.bias),
                                    layer.attn_out_norm, layer.eps).apply_add
    if "mlp" in projs:
        ops["mlp"] = OneDNNGated(layer.gate_up_proj.weight, layer.gate_up_proj.bias,
                                 layer.intermediate_size, layer.gelu).apply
    if "down" in projs:
        ops["down"] = with_output_norm(OneDNN(onednn_pack(layer.down_proj.weight),
            layer.down_proj.bias), layer.mlp_out_norm, layer.eps).apply_add
    return ops


def panel_ops(layer, projs: tuple[str, ...] = PROJECTIONS,
              fused: bool = False) -> dict[str, Callable]:
    """kvserve's panel GEMM (panel_gemm.py) on packed copies of the weights (made here), for
    `projs` only: bias and the residual add in its epilogue, the gated activation too.
    `fused`: the layer's ops (see LayerMethods), the norms before qkv and gate/up in those
    GEMMs' calls and RoPE on qkv's output (as `attn_in_unfused`); else GEMMs on normed x (the
    GEMM ceiling's)."""
    if not projs:
        return {}
    g = panel_gemm.load()
    if g is None:
        raise ValueError("the panel GEMM kernel cannot be built here")
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        norm = layer.input_layernorm if fused else None
        qkv = Panel(g.bind(g.pack(layer.qkv_proj.weight), layer.qkv_proj.bias, norm,
            layer.eps)).apply
        ops["qkv"] = attn_in_after_norm(layer, qkv) if fused else qkv
    if "o" in projs:
        ops["o"] = with_output_norm(Panel(g.bind(g.pack(layer.o_proj.weight), layer.o_proj.bias)),
                                    layer.attn_out_norm, layer.eps).apply_add
    if "mlp" in projs:
        norm = layer.post_attention_layernorm if fused else None
        act = "gelu_pytorch_tanh" if layer.gelu else "silu"
        ops["mlp"] = Panel(g.bind(g.pack(layer.gate_up_proj.weight, act), layer.gate_up_proj.bias,
            norm, layer.eps)).apply
    if "down" in projs:
        ops["down"] = with_output_norm(Panel(g.bind(g.pack(layer.down_proj.weight),
            layer.down_proj.bias)), layer.mlp_out_norm, layer.eps).apply_add
    return ops


def gemv_ops(layer, projs: tuple[str, ...] = PROJECTIONS,
             fused: bool = False) -> dict[str, Callable]:
    """The C++ GEMV on the row-major weights (for a few rows: gemv.MAX_ROWS), with bias, the
    gated activation and the residual add fused, for `projs` only. `fused`: the layer's ops
    (see LayerMethods) with the norms before qkv and gate/up, and the RoPE of q and k (unless
    the model norms q and k first), in the same calls; else plain GEMMs on normed x (what
    gemm_select times against the other kernels)."""
    g = gemv.load()
    ops: dict[str, Callable] = {}
    eps, d = layer.eps, layer.head_dim
    if "qkv" in projs:
        norm = {"norm_weight": layer.input_layernorm, "eps": eps} \
            if fused and layer.input_layernorm is not None else {}
        rope_cols = layer.qk_size if fused and layer.qk_norm is None else 0
        qkv = g.bind(layer.qkv_proj.weight, layer.qkv_proj.bias, rope_cols=rope_cols, head_dim=d,
            **norm)
        if not fused:
            ops["qkv"] = qkv
        elif rope_cols:
            ops["qkv"] = lambda h, cs: split_qkv(layer, qkv(h, None, cs), cs)
        else:  # q/k norms sit between the projection and RoPE
            ops["qkv"] = lambda h, cs: split_qkv(layer, qkv(h), cs, rope=apply_rope)
    if "o" in projs:
        ops["o"] = gemv_output_add(g, layer.o_proj.weight, layer.o_proj.bias, layer.attn_out_norm,
            eps)
    if "mlp" in projs:
        norm = {"norm_weight": layer.post_attention_layernorm, "eps": eps} \
            if fused and layer.post_attention_layernorm is not None else {}
        mode = gemv.MODE_GELU_MUL if layer.gelu else gemv.MODE_SILU_MUL
        ops["mlp"] = g.bind(layer.gate_up_proj.weight, layer.gate_up_proj.bias, mode, **norm)
    if "down" in projs:
        ops["down"] = gemv_output_add(g, layer.down_proj.weight, layer.down_proj.bias,
            layer.mlp_out_norm, eps)
    return ops


def gemv_output_add(g: gemv.Gemv, w: torch.Tensor, b: torch.Tensor | None,
                    out_norm: torch.Tensor | None, eps: float
                    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, residual) -> residual + x W^T + b on the GEMV: the add into the residual stream in
    the kernel, or (Gemma's output norms) GEMV, norm, add."""
    if out_norm is None:
        return Gemv(g.bind(w, b, gemv.MODE_ADD)).apply_add
    return with_output_norm(Gemv(g.bind(w, b)), out_norm, eps).apply_add
