"""A decoder layer's methods for one row bucket (`LayerMethods`): its four projections, each
with the element-wise work around it, as the layer's forward calls them. The model holds one
per bucket and never asks which kernel is behind them; `dense_methods` are the kernel-free
ones (F.linear, or the GPU's with its Triton ops), `cpu_methods.PlannedDecoder` makes the
CPU's per the GEMM plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.layers.linear import Dense, DenseGated, LinearMethod, with_output_norm
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope

PROJECTIONS = ("qkv", "o", "mlp", "down")
# The DecoderLayer attributes of those projections' weights (what a quantized checkpoint may
# hold as blocks)
PROJECTION_ATTRS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LayerMethods:
    """One layer's four projections for one row bucket, each with the element-wise work around
    it: attn_in(residual, cos_sin) -> q, k, v (input norm, qkv GEMM, q/k norm, RoPE),
    o_add(o, residual), mlp(residual) (post-attention norm, gate/up GEMM, the gated
    activation), down_add(m, residual). With Gemma's output norms the adds are
    residual + norm(x W^T + b): there the add cannot be fused into the GEMM."""

    attn_in: Callable[[torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    o_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]
    down_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # o_add, mlp and down_add as one call (the GEMV's gemv.BoundMLPBlock), where a bucket
    # runs all three on the GEMV and the model has no output norms
    o_mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def split_qkv(layer, qkv: torch.Tensor, cos_sin: torch.Tensor, norm: Callable = rms_norm,
              rope: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, q + 2 kv] -> q [T, H, D], k [T, Hkv, D] (q/k-normed where the model has it,
    then RoPE: `rope`, or none when the kernel already rotated them), v [T, Hkv, D] (views).
    `layer`: a DecoderLayer (its head counts and q/k norm weight)."""
    t, d = qkv.shape[0], layer.head_dim
    qk = qkv[:, : layer.qk_size].view(t, layer.num_heads + layer.num_kv_heads, d)
    w = layer.qk_norm
    if w is not None and w.dim() == 2:
        qk = norm(qk, w, layer.eps)  # per-head weight [heads, D]
    elif w is not None:  # over the whole q, then the whole k (OLMo 2)
        q = layer.q_size
        qk = torch.cat((norm(qkv[:, :q], w[:q], layer.eps),
                        norm(qkv[:, q: layer.qk_size], w[q:], layer.eps)), dim=1).view(qk.shape)
    if rope is not None:
        qk = rope(qk, cos_sin)
    return (qk[:, : layer.num_heads], qk[:, layer.num_heads:],
            qkv[:, layer.qk_size:].view(t, layer.num_kv_heads, d))


def normed(norm: Callable, weight: torch.Tensor | None, eps: float,
           fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> fn(norm(x)); fn itself where the model has no such norm (weight None)."""
    if weight is None:
        return fn
    return lambda x: fn(norm(x, weight, eps))


def dense_methods(layer, norm: Callable = rms_norm, rope: Callable = apply_rope,
                  gate_up: LinearMethod | None = None, o: LinearMethod | None = None,
                  down: LinearMethod | None = None) -> LayerMethods:
    """A DecoderLayer's methods without a GEMM plan: `Dense` projections on its row-major
    weights, `norm` and `rope` around them (the GPU passes its Triton kernels), `gate_up` the
    gated MLP projection (default DenseGated), `o` and `down` the projections before the
    residual adds (default Dense; tensor parallelism's all-reducing ones). A layer whose MLP
    is routed experts (`layer.moe`, Qwen3-MoE, Mixtral) runs them after its post-attention
    norm: they add their own sum into the residual stream (all-reduced on a rank)."""
    eps = layer.eps
    qkv = normed(norm, layer.input_layernorm, eps,
                 Dense(layer.qkv_proj.weight, layer.qkv_proj.bias).apply)

    def attn_in(h: torch.Tensor, cos_sin: torch.Tensor) -> tuple:
        return split_qkv(layer, qkv(h), cos_sin, norm, rope)

    o = with_output_norm(o or Dense(layer.o_proj.weight, layer.o_proj.bias), layer.attn_out_norm,
                         eps, norm)
    moe = getattr(layer, "moe", None)
    if moe is not None:
        mlp = normed(norm, layer.post_attention_layernorm, eps, lambda x: x)
        return LayerMethods(attn_in, o.apply_add, mlp, moe.forward_add)
    gate_up = gate_up or DenseGated(layer.gate_up_proj.weight, layer.gate_up_proj.bias,
                                    layer.intermediate_size, layer.gelu)
    mlp = normed(norm, layer.post_attention_layernorm, eps, gate_up.apply)
    down = with_output_norm(down or Dense(layer.down_proj.weight, layer.down_proj.bias),
                            layer.mlp_out_norm, eps, norm)
    return LayerMethods(attn_in, o.apply_add, mlp, down.apply_add)
