"""One config-driven decoder for Llama, Qwen2, Qwen3, Mistral, Gemma 3 (text), Phi-3 and OLMo 2;
which architecture sets which switch is `kvserve/models/`' business, one module per family.

Gemma 3 is the same decoder with a few switches from its config: embeddings scaled by
sqrt(hidden_size), norms that scale by (1 + weight) (the loader stores 1 + weight, so the norm
code is shared), the attention and MLP outputs normed before their residual adds, per-head q/k
norms (as Qwen3), a GELU-tanh gate, the attention scale from `query_pre_attn_scalar`, a RoPE base
per layer type (local and global layers), and tanh soft-capping of the final logits.
Phi-3's partial RoPE is a RoPE table whose last frequencies are 0 (its weight map permutes the
q/k dimensions to match, `kvserve.models.weights.partial_rotary_rows`). OLMo 2 has the output
norms without the norms before attention and the MLP (`pre_norms` False: those ops then read
the residual stream as it is) and norms q and k over the whole projection, not per head.

The model runs on a flat batch: `T` new tokens from any number of sequences, with no batch
dimension and no padding. Everything that depends on which sequence a token belongs to (the
KV cache, masks) lives behind the `AttentionFn` the caller passes in.

Layout, chosen for the CPU hot path:
  * q, k and v projections are one matrix `qkv_proj` ([q; k; v] rows), gate and up are one
    matrix `gate_up_proj` ([gate; up] rows), so each layer runs four GEMMs;
  * the residual add is folded into the o_proj and down_proj GEMMs (`addmm_` with beta=1 writes
    straight into the residual stream, or oneDNN's "add" post-op, below), except with Gemma's
    output norms, which sit between the GEMM and the add;
  * RoPE uses Hugging Face's rotate-half convention (the first half of each head pairs with the
    second half), with cos/sin precomputed once in float32 and gathered once per step;
  * on the CPU `CausalLM.pack_weights()` (called by the loader) gives each projection and the
    LM head the GEMM kernel that measures fastest on this CPU for each row bucket
    (gemm_select.py): `F.linear` (MKL in float32) or oneDNN on weights packed in its blocked
    layout with the gate's SiLU (or GELU-tanh), the gated product and the residual add as
    fused epilogues. Which wins
    depends on the CPU and the batch: on a Zen 5 oneDNN was ~2x faster at every size; on an
    AVX-512 Xeon MKL wins at batch 1; on an AVX2 EPYC oneDNN loses at batch 1 and wins at
    batch 64 for some shapes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import hugepages
from kvserve.layers import gemm_select
from kvserve.kernels.cpu import gemv, panel_gemm
from kvserve.attention.base import AttentionFn
from kvserve.layers.fast_decode import FastDecode
from kvserve.model.config import ModelConfig
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.layers.gemm_select import GemmPlan

logger = logging.getLogger("kvserve")


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    # Not initialised here: the loader fills every parameter. On the CPU the memory is
    # hugepages.empty's (2 MiB pages asked for before the loader's first write).
    if device is None or torch.device(device).type == "cpu":
        return nn.Parameter(hugepages.empty(shape, dtype), requires_grad=False)
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


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


def rope_inv_freq(config: ModelConfig, theta: float | None = None,
                  scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32), with transformers' linear/llama3 scaling;
    the config's (full layers') RoPE unless `theta` (and `scaling`) are given. With a partial
    `rotary_dim` the frequencies are rotary_dim's, padded with zeros to head_dim / 2: those
    dimensions pass through unrotated (cos 1, sin 0)."""
    inv_freq = _inv_freq(config, theta, scaling)
    pad = config.head_dim // 2 - inv_freq.shape[0]
    return F.pad(inv_freq, (0, pad)) if pad else inv_freq


def _inv_freq(config: ModelConfig, theta: float | None, scaling: dict | None) -> torch.Tensor:
    dim = config.rotary_dim or config.head_dim
    if theta is None:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(theta, dim, factor, scaling)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


def _yarn_inv_freq(base: float, dim: int, factor: float, scaling: dict) -> torch.Tensor:
    """YaRN (DeepSeek's rope_scaling): interpolated frequencies below the correction range,
    extrapolated above, a linear ramp between; transformers' `_compute_yarn_parameters`."""
    def correction_dim(rotations: float) -> float:
        old_len = scaling["original_max_position_embeddings"]
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_cache(config: ModelConfig, device: torch.device | str | None = None,
               theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """[max_position_embeddings, head_dim]: cos of each angle in the first half, sin in the
    second, computed in float32 exactly as transformers computes them per step (times YaRN's
    attention factor, as transformers scales its cos/sin)."""
    if theta is None:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv_freq = rope_inv_freq(config, theta, scaling)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    attention_factor = (scaling or {}).get("attention_factor", 1.0)
    if attention_factor != 1.0:
        cache = cache * attention_factor
    return cache if device is None else cache.to(device)


# -- GEMM back ends: (x, weight, bias) -> y and (x, residual, weight, bias) -> residual + y ----
def _dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _dense_linear_add(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                      b: torch.Tensor | None) -> torch.Tensor:
    residual.addmm_(x, w.t())  # beta=1 GEMM straight into the residual stream
    return residual if b is None else residual.add_(b)


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


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
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


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(_pad_rows(x), w, b, "none", [], "")[: x.shape[0]]


def _onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                       b: torch.Tensor | None) -> torch.Tensor:
    t = x.shape[0]
    if gemm_rows(t) == t:  # in place into the residual stream
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, b, "add")
    return torch.ops.mkldnn._linear_pointwise.binary(
        _pad_rows(x), _pad_rows(residual), w, b, "add")[:t]


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
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
        w = _onednn_pack(torch.ones(8, 8, dtype=dtype))
        y = _onednn_linear_add(torch.ones(2, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype), w,
                               None)
        return bool((y == 9).all())
    except Exception:  # noqa: BLE001 - any failure means "use F.linear"
        return False


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_size = c.q_size
        self.qk_size = c.q_size + c.kv_size
        self.intermediate_size = c.intermediate_size
        self.eps = c.rms_norm_eps
        p = dict(dtype=dtype, device=device)
        h, qkv = c.hidden_size, c.q_size + 2 * c.kv_size
        self.hidden_size = h
        # The norm before attention (None without pre-norms: OLMo 2)
        self.input_layernorm = _param(h, **p) if c.pre_norms else None
        self.qkv_proj = _param(qkv, h, **p)
        self.qkv_bias = _param(qkv, **p) if c.attention_bias else None
        # Per head (Qwen3, Gemma 3): q_norm repeated over the q heads, then k_norm over the kv
        # heads, [heads + kv heads, head_dim], so that one normalisation covers q and k
        # together. Over the whole projection (OLMo 2): [q_size + kv_size], q's then k's.
        if not c.qk_norm:
            self.qk_norm = None
        elif c.qk_norm_per_head:
            self.qk_norm = _param(c.num_attention_heads + c.num_key_value_heads, c.head_dim, **p)
        else:
            self.qk_norm = _param(c.q_size + c.kv_size, **p)
        self.o_proj = _param(h, c.q_size, **p)
        self.o_bias = _param(h, **p) if c.o_proj_bias else None
        # The norm before the MLP (Llama's post_attention_layernorm, Gemma's
        # pre_feedforward_layernorm; None without pre-norms).
        self.post_attention_layernorm = _param(h, **p) if c.pre_norms else None
        # Gemma 3, OLMo 2: norms of the attention and MLP outputs, before their residual adds.
        self.attn_out_norm = _param(h, **p) if c.output_norms else None
        self.mlp_out_norm = _param(h, **p) if c.output_norms else None
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = _param(2 * c.intermediate_size, h, **p)
        self.gate_up_bias = _param(2 * c.intermediate_size, **p) if c.mlp_bias else None
        self.down_proj = _param(h, c.intermediate_size, **p)
        self.down_bias = _param(h, **p) if c.mlp_bias else None
        self._linear = _dense_linear
        self._linear_add = _dense_linear_add
        self._norm = rms_norm
        self._rope = _apply_rope
        self._ops: list[_LayerOps] = []  # per gemm_select bucket, once a GEMM plan is set
        self._mlp_chunk_rows: int | None = None  # set with a GEMM plan (CPU): mlp_chunk_rows
        # (qkv, MLP block) bound GEMV ops of the first bucket, where the plan allows
        # fast_decode.FastDecode
        self.fast_decode_ops: tuple[gemv.BoundGemv, gemv.BoundMLPBlock] | None = None
        # Without a plan (the GPU path, unpacked models): this layer's own swappable
        # norm / RoPE / GEMM functions (use_triton_ops swaps them).
        self._fallback = _LayerOps(self._attn_in, self._o_add, self._mlp, self._down_add)

    def use_triton_ops(self) -> None:
        """Fused Triton RMSNorm / RoPE / SiLU-and-mul (`kvserve.kernels.gpu.ops`): the GPU path,
        where each PyTorch element-wise op is a kernel launch. Not with oneDNN-packed weights."""
        from kvserve.kernels.gpu import ops as gpu_ops

        self._norm = gpu_ops.rms_norm
        self._rope = gpu_ops.apply_rope
        if self.gate_up_proj is not None and not self.gelu:
            self._swiglu = self._swiglu_triton

    def _swiglu_triton(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.kernels.gpu import ops as gpu_ops

        return gpu_ops.silu_mul(self._linear(x, self.gate_up_proj, self.gate_up_bias))

    # -- GEMM kernels per row bucket (gemm_select.py) ---------------------------------------
    def gemm_candidates(self, layer_ops: bool = True
                        ) -> dict[str, dict[str, gemm_select.RunFactory]]:
        """For each projection and kernel, a factory(rows) -> run-once callable on this layer's
        own weights (oneDNN-packed copies made here and dropped after): what `gemm_select`
        times. Call before `set_gemm_plan`, while the dense weights are all there.

        layer_ops: time each kernel's projection as the layer runs it (qkv with the input norm
        and RoPE around it, gate/up with the post-attention norm): the GEMV and the panel GEMM
        norm in their own calls, the other kernels run the norms as separate ops, and the
        choice should see that. False: the GEMMs alone (the benchmarks' GEMM ceiling). Each
        kernel's ops (and packed copies) are made when a factory of it is first called."""
        p = {"dtype": self.qkv_proj.dtype, "device": self.qkv_proj.device}
        builders = {"dense": lambda: _dense_ops(self)}
        if onednn_available(**p):
            builders["onednn"] = lambda: _onednn_ops(self)
        if gemv_available(**p):
            builders["gemv"] = lambda: _gemv_ops(self, fused=layer_ops)
        if panel_gemm.available(**p):
            builders["panel"] = lambda: _panel_ops(self, fused=layer_ops)
        built: dict[str, dict[str, Callable]] = {}
        h, q = self.qkv_proj.shape[1], self.q_size

        def factory(kind: str, kernel: str) -> gemm_select.RunFactory:
            def make(rows: int) -> Callable[[], object] | None:
                if not gemm_select.offered(kernel, gemm_select.bucket_of(rows)):
                    return None
                if kernel not in built:
                    built[kernel] = builders[kernel]()
                    if layer_ops:
                        _wrap_unfused(self, kernel, built[kernel])
                ops = built[kernel]
                x = torch.randn(rows, h, **p)
                if kind == "qkv" and layer_ops:
                    cos_sin = torch.rand(rows, self.head_dim, **p)
                    return lambda: ops["qkv"](x, cos_sin)
                if kind == "qkv":
                    return lambda: ops["qkv"](x)
                if kind == "o":
                    xo, r = torch.randn(rows, q, **p), torch.zeros(rows, h, **p)
                    return lambda: ops["o"](xo, r)
                if kind == "mlp":
                    return lambda: ops["mlp"](x)
                xd = torch.randn(rows, self.intermediate_size, **p)
                r = torch.zeros(rows, h, **p)
                return lambda: ops["down"](xd, r)
            return make

        return {kind: {k: factory(kind, k) for k in builders} for kind in _PROJS}

    def set_gemm_plan(self, plan: GemmPlan) -> None:
        """Bind one set of projection ops per row bucket as `plan` says: pack (oneDNN) the
        weights some bucket runs through oneDNN, free the dense ones no bucket uses.

        Gate and up are packed apart: SiLU then runs as the gate GEMM's epilogue and the product
        as the up GEMM's, which saves two passes over the [T, intermediate] activations (the
        SwiGLU element-wise work was ~12% of a decode step)."""
        built = {"dense": _dense_ops(self, tuple(p for p in _PROJS if plan.uses(p, "dense"))),
                 "onednn": _onednn_ops(self, tuple(p for p in _PROJS if plan.uses(p, "onednn"))),
                 "gemv": _gemv_ops(self, tuple(p for p in _PROJS if plan.uses(p, "gemv")),
                                   fused=True),
                 "panel": _panel_ops(self, tuple(p for p in _PROJS if plan.uses(p, "panel")),
                                     fused=True)}
        for kernel, ops in built.items():
            _wrap_unfused(self, kernel, ops)
        self._ops = []
        self._mlp_chunk_rows = mlp_chunk_rows(self.intermediate_size, self.o_proj.element_size())
        block = None
        self.fast_decode_ops = None
        for b in range(len(gemm_select.BUCKETS)):
            ops = {p: built[plan.kernels[p][b]][p] for p in _PROJS}
            fused = None
            if all(plan.kernels[p][b] == "gemv" for p in ("o", "mlp", "down")) \
                    and self.attn_out_norm is None and self.mlp_out_norm is None \
                    and self.post_attention_layernorm is not None:
                block = block or gemv.load().bind_mlp_block(
                    self.o_proj, self.o_bias, self.post_attention_layernorm, self.eps,
                    self.gate_up_proj, self.gate_up_bias, self.down_proj, self.down_bias,
                    self.gelu)
                fused = block
            self._ops.append(_LayerOps(ops["qkv"], ops["o"], ops["mlp"], ops["down"], fused))
            if b == 0 and fused is not None and plan.kernels["qkv"][0] == "gemv" \
                    and self.qk_norm is None and self.input_layernorm is not None:
                # the whole layer as bound C++ ops, for fast_decode.FastDecode
                self.fast_decode_ops = (gemv.load().bind(
                    self.qkv_proj, self.qkv_bias, norm_weight=self.input_layernorm,
                    eps=self.eps, rope_cols=self.qk_size, head_dim=self.head_dim), fused)
        # free the dense weights no bucket reads (the closures hold what they need)
        for proj, name in (("qkv", "qkv_proj"), ("o", "o_proj"), ("mlp", "gate_up_proj"),
                           ("down", "down_proj")):
            if not any(plan.uses(proj, k) for k in gemm_select.ROW_MAJOR):
                setattr(self, name, None)

    def gemm_flops_per_row(self) -> int:
        """FLOPs of this layer's projections per token (for the warm-up's budget)."""
        h = self.hidden_size
        qkv = self.q_size + 2 * self.num_kv_heads * self.head_dim
        return 2 * (h * qkv + self.q_size * h + 3 * h * self.intermediate_size)

    def warm_up_gemms(self, x: torch.Tensor, bucket: int) -> None:
        """Run each projection of row bucket `bucket` once on zeros x [rows, hidden] (compiles
        its oneDNN kernel; a dense one compiles nothing and costs little)."""
        ops = self._ops[bucket]
        ops.attn_in(x, torch.zeros(x.shape[0], self.head_dim, dtype=x.dtype, device=x.device))
        zeros = torch.zeros(x.shape[0], self.q_size, dtype=x.dtype, device=x.device)
        ops.o_add(zeros, x.clone())
        ops.down_add(ops.mlp(x), x.clone())

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor,
                attn: AttentionFn, bucket: int = 0) -> torch.Tensor:
        """hidden [T, hidden_size] is the residual stream; it may be updated in place.
        `bucket` (gemm_select.bucket_of(T)) picks the GEMM kernels bound for this size."""
        ops = self._ops[bucket] if self._ops else self._fallback
        q, k, v = ops.attn_in(hidden, cos_sin)
        o = attn(self.layer_idx, q, k, v).reshape(hidden.shape[0], self.q_size)
        if ops.o_mlp is not None:
            return ops.o_mlp(o, hidden)
        hidden = ops.o_add(o, hidden)
        chunk = self._mlp_chunk_rows
        if chunk is None or hidden.shape[0] <= chunk:
            return ops.down_add(ops.mlp(hidden), hidden)
        # A long prefill's MLP a chunk of rows at a time (see mlp_chunk_rows)
        ops = self._ops[gemm_select.bucket_of(chunk)]
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            out = ops.down_add(ops.mlp(h), h)
            if out.data_ptr() != h.data_ptr():  # a kernel that could not add in place
                h.copy_(out)
        return hidden

    # -- the fallback ops (no GEMM plan): late-bound, so use_triton_ops' swaps apply ----------
    def _attn_in(self, hidden: torch.Tensor, cos_sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = _pre_norm(self._norm, hidden, self.input_layernorm, self.eps)
        return _split_qkv(self, self._linear(x, self.qkv_proj, self.qkv_bias), cos_sin,
                          self._norm, self._rope)

    def _o_add(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self._project_add(o, hidden, self.o_proj, self.o_bias, self.attn_out_norm)

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        x = _pre_norm(self._norm, hidden, self.post_attention_layernorm, self.eps)
        return self._swiglu(x)

    def _down_add(self, m: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self._project_add(m, hidden, self.down_proj, self.down_bias, self.mlp_out_norm)

    def _project_add(self, x: torch.Tensor, hidden: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None, out_norm: torch.Tensor | None) -> torch.Tensor:
        """Into the residual: fused with the projection unless Gemma norms the block's output."""
        if out_norm is None:
            return self._linear_add(x, hidden, w, b)
        return hidden.add_(self._norm(self._linear(x, w, b), out_norm, self.eps))

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation(gate) * up (SiLU, or Gemma's GELU-tanh)."""
        return _gated(self._linear(x, self.gate_up_proj, self.gate_up_bias),
                      self.intermediate_size, self.gelu)


def _split_qkv(layer: DecoderLayer, qkv: torch.Tensor, cos_sin: torch.Tensor,
               norm: Callable = rms_norm, rope: Callable | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, q + 2 kv] -> q [T, H, D], k [T, Hkv, D] (q/k-normed where the model has it,
    then RoPE: `rope`, or none when the GEMV already rotated them), v [T, Hkv, D] (views)."""
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


def _attn_in_unfused(layer: DecoderLayer, qkv: Callable[[torch.Tensor], torch.Tensor]
                     ) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """(residual, cos_sin) -> q, k, v around a qkv GEMM on normed x: norm, GEMM, split, RoPE.
    In float32 on the CPU the norm is the C++ kernel of gemv.py rather than torch ops."""
    w, eps = layer.input_layernorm, layer.eps
    if w is None:  # no pre-norm: the GEMM reads the residual stream
        return _attn_in_after_norm(layer, qkv)
    g = gemv.load() if gemv_available(w.dtype, w.device) else None
    norm = g.rms_norm if g is not None else rms_norm
    return _attn_in_after_norm(layer, lambda h: qkv(norm(h, w, eps)))


def _attn_in_after_norm(layer: DecoderLayer, qkv: Callable[[torch.Tensor], torch.Tensor]
                        ) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """(residual, cos_sin) -> q, k, v around `qkv` (residual -> q | k | v, normed inside):
    split, q/k norms, RoPE. In float32 on the CPU (without q/k norms) the RoPE is gemv.py's
    C++ kernel, in place on the GEMM's output."""
    w = layer.o_proj
    g = gemv.load() if gemv_available(w.dtype, w.device) else None
    if g is None or layer.qk_norm is not None:  # q/k norms sit between projection and RoPE
        return lambda h, cos_sin: _split_qkv(layer, qkv(h), cos_sin, rope=_apply_rope)
    cols, d = layer.qk_size, layer.head_dim
    return lambda h, cos_sin: _split_qkv(layer, g.rope_(qkv(h), cos_sin, cols, d), cos_sin)


def _wrap_unfused(layer: DecoderLayer, kernel: str, ops: dict[str, Callable]) -> None:
    """Turn a GEMM-level ops dict of `kernel` into the layer's ops (see _LayerOps), in place:
    the GEMMs take normed x, the layer's ops the residual stream. The GEMV's and the panel
    GEMM's fused ops already are."""
    if kernel in _FUSED_KERNELS:
        return
    if "qkv" in ops:
        ops["qkv"] = _attn_in_unfused(layer, ops["qkv"])
    if "mlp" in ops and layer.post_attention_layernorm is not None:
        mlp, w, eps = ops["mlp"], layer.post_attention_layernorm, layer.eps
        g = gemv.load() if gemv_available(w.dtype, w.device) else None
        norm = g.rms_norm if g is not None else rms_norm
        ops["mlp"] = lambda x: mlp(norm(x, w, eps))


MLP_CHUNK_BYTES = 16 << 20  # gate/up activations of one chunk of a long prefill's MLP
MLP_CHUNK_MIN_ROWS = 256


def mlp_chunk_rows(intermediate_size: int, element_size: int) -> int:
    """Rows per chunk of a long prefill's MLP on the CPU: the gate/up activations ([rows,
    2 x intermediate]) of one chunk stay near MLP_CHUNK_BYTES, at least MLP_CHUNK_MIN_ROWS
    rows (the GEMMs' efficiency), a multiple of 64.

    Why: the MLP of a whole 8,192-token step wrote and re-read 92 MB of gate/up activations
    (the reference model) that no cache held. Measured per row, 2 threads: MKL + SwiGLU
    ~9.6 us at 1,000-2,000 rows, 12.5 at 3,000, 14.3 at 8,192 (oneDNN 9.9 -> 13.0); the
    rows are independent, so chunks change no result."""
    rows = MLP_CHUNK_BYTES // max(1, 2 * intermediate_size * element_size)
    return max(MLP_CHUNK_MIN_ROWS, rows // 64 * 64)


def _pre_norm(norm: Callable, x: torch.Tensor, weight: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    """norm(x) before attention or the MLP; x itself where the model has no such norm."""
    return x if weight is None else norm(x, weight, eps)


def _gated(gate_up: torch.Tensor, i: int, gelu: bool) -> torch.Tensor:
    """[T, 2i] gate | up -> act(gate) * up, act SiLU or (Gemma) GELU-tanh; reuses the gate."""
    gate = gate_up[:, :i]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return act.mul_(gate_up[:, i:])



@dataclass
class _LayerOps:
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


_PROJS = ("qkv", "o", "mlp", "down")
# kernels whose fused ops (gemm_candidates' layer_ops) take the norms before qkv and gate/up
_FUSED_KERNELS = ("gemv", "panel")

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
LinearAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                     torch.Tensor]


def _output_add(linear: Linear, linear_add: LinearAdd, w: torch.Tensor, b: torch.Tensor | None,
                out_norm: torch.Tensor | None, eps: float
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, residual) -> residual + x W^T + b, the add fused into the GEMM; with an output norm
    (Gemma 3) residual + out_norm(x W^T + b): GEMM, then norm, then add."""
    if out_norm is None:
        return lambda x, r: linear_add(x, r, w, b)
    return lambda x, r: r.add_(rms_norm(linear(x, w, b), out_norm, eps))


def _dense_ops(layer: DecoderLayer, projs: tuple[str, ...] = _PROJS) -> dict[str, Callable]:
    """F.linear / addmm_ on the row-major weights (MKL for float32), for `projs` only (a
    closure keeps its weight alive)."""
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        qkv_w, qkv_b = layer.qkv_proj, layer.qkv_bias
        ops["qkv"] = lambda x: F.linear(x, qkv_w, qkv_b)
    if "o" in projs:
        ops["o"] = _output_add(_dense_linear, _dense_linear_add, layer.o_proj, layer.o_bias,
                               layer.attn_out_norm, layer.eps)
    if "mlp" in projs:
        gu_w, gu_b, i = layer.gate_up_proj, layer.gate_up_bias, layer.intermediate_size
        gelu = layer.gelu

        ops["mlp"] = lambda x: _gated(F.linear(x, gu_w, gu_b), i, gelu)
    if "down" in projs:
        ops["down"] = _output_add(_dense_linear, _dense_linear_add, layer.down_proj,
                                  layer.down_bias, layer.mlp_out_norm, layer.eps)
    return ops


def _onednn_ops(layer: DecoderLayer, projs: tuple[str, ...] = _PROJS) -> dict[str, Callable]:
    """oneDNN on packed copies of the weights (made here), for `projs` only: the gate's
    activation (SiLU, or Gemma's GELU-tanh: oneDNN's "gelu" with the "tanh" algorithm) and the
    product with up fused as GEMM epilogues, and the residual adds too where no output norm
    sits between GEMM and add."""
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        qkv_w, qkv_b = _onednn_pack(layer.qkv_proj), layer.qkv_bias
        ops["qkv"] = lambda x: _onednn_linear(x, qkv_w, qkv_b)
    if "o" in projs:
        ops["o"] = _output_add(_onednn_linear, _onednn_linear_add, _onednn_pack(layer.o_proj),
                               layer.o_bias, layer.attn_out_norm, layer.eps)
    if "mlp" in projs:
        i = layer.intermediate_size
        gate_w = _onednn_pack(layer.gate_up_proj[:i])
        up_w = _onednn_pack(layer.gate_up_proj[i:])
        bias = layer.gate_up_bias
        gate_b = None if bias is None else bias[:i].contiguous()
        up_b = None if bias is None else bias[i:].contiguous()
        act, algorithm = ("gelu", "tanh") if layer.gelu else ("swish", "")

        def mlp(x: torch.Tensor) -> torch.Tensor:
            t = x.shape[0]
            x = _pad_rows(x)  # a few cached GEMM shapes, not one per token count
            gate = torch.ops.mkldnn._linear_pointwise(x, gate_w, gate_b, act, [], algorithm)
            return torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_w, up_b, "mul")[:t]

        ops["mlp"] = mlp
    if "down" in projs:
        ops["down"] = _output_add(_onednn_linear, _onednn_linear_add,
                                  _onednn_pack(layer.down_proj), layer.down_bias,
                                  layer.mlp_out_norm, layer.eps)
    return ops


def _panel_ops(layer: DecoderLayer, projs: tuple[str, ...] = _PROJS,
               fused: bool = False) -> dict[str, Callable]:
    """kvserve's panel GEMM (panel_gemm.py) on packed copies of the weights (made here), for
    `projs` only: bias and the residual add in its epilogue, the gated activation too.
    `fused`: the layer's ops (see _LayerOps), the norms before qkv and gate/up in those GEMMs'
    calls and RoPE on qkv's output (as `_attn_in_unfused`); else GEMMs on normed x (the GEMM
    ceiling's)."""
    if not projs:
        return {}
    g = panel_gemm.load()
    if g is None:
        raise ValueError("the panel GEMM kernel cannot be built here")
    ops: dict[str, Callable] = {}
    if "qkv" in projs:
        norm = layer.input_layernorm if fused else None
        qkv = g.bind(g.pack(layer.qkv_proj), layer.qkv_bias, norm, layer.eps)
        ops["qkv"] = _attn_in_after_norm(layer, qkv) if fused else qkv
    if "o" in projs:
        ops["o"] = _output_add(_panel_linear, _panel_linear_add,
                               g.bind(g.pack(layer.o_proj), layer.o_bias), None,
                               layer.attn_out_norm, layer.eps)
    if "mlp" in projs:
        norm = layer.post_attention_layernorm if fused else None
        act = "gelu_pytorch_tanh" if layer.gelu else "silu"
        ops["mlp"] = g.bind(g.pack(layer.gate_up_proj, act), layer.gate_up_bias, norm, layer.eps)
    if "down" in projs:
        ops["down"] = _output_add(_panel_linear, _panel_linear_add,
                                  g.bind(g.pack(layer.down_proj), layer.down_bias), None,
                                  layer.mlp_out_norm, layer.eps)
    return ops


def _panel_linear(x: torch.Tensor, w: panel_gemm.BoundPanel, b: None) -> torch.Tensor:
    return w(x)  # (the bias is bound in w)


def _panel_linear_add(x: torch.Tensor, residual: torch.Tensor, w: panel_gemm.BoundPanel,
                      b: None) -> torch.Tensor:
    return w(x, residual)


def gemv_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ GEMV kernel (gemv.py) can run this model's projections."""
    return device.type == "cpu" and dtype == torch.float32 and gemv.load() is not None


def _gemv_ops(layer: DecoderLayer, projs: tuple[str, ...] = _PROJS,
              fused: bool = False) -> dict[str, Callable]:
    """The C++ GEMV on the row-major weights (for a few rows: gemv.MAX_ROWS), with bias, the
    gated activation and the residual add fused, for `projs` only. `fused`: the layer's ops
    (see _LayerOps) with the norms before qkv and gate/up, and the RoPE of q and k (unless
    the model norms q and k first), in the same calls; else plain GEMMs on normed x (what
    gemm_select times against the other kernels)."""
    g = gemv.load()
    ops: dict[str, Callable] = {}
    eps, d = layer.eps, layer.head_dim
    if "qkv" in projs:
        norm = {"norm_weight": layer.input_layernorm, "eps": eps} \
            if fused and layer.input_layernorm is not None else {}
        rope_cols = layer.qk_size if fused and layer.qk_norm is None else 0
        qkv = g.bind(layer.qkv_proj, layer.qkv_bias, rope_cols=rope_cols, head_dim=d, **norm)
        if not fused:
            ops["qkv"] = qkv
        elif rope_cols:
            ops["qkv"] = lambda h, cs: _split_qkv(layer, qkv(h, None, cs), cs)
        else:  # q/k norms sit between the projection and RoPE
            ops["qkv"] = lambda h, cs: _split_qkv(layer, qkv(h), cs, rope=_apply_rope)
    if "o" in projs:
        ops["o"] = _gemv_output_add(g, layer.o_proj, layer.o_bias, layer.attn_out_norm, eps)
    if "mlp" in projs:
        norm = {"norm_weight": layer.post_attention_layernorm, "eps": eps} \
            if fused and layer.post_attention_layernorm is not None else {}
        mode = gemv.MODE_GELU_MUL if layer.gelu else gemv.MODE_SILU_MUL
        ops["mlp"] = g.bind(layer.gate_up_proj, layer.gate_up_bias, mode, **norm)
    if "down" in projs:
        ops["down"] = _gemv_output_add(g, layer.down_proj, layer.down_bias, layer.mlp_out_norm,
                                       eps)
    return ops


def _gemv_output_add(g: gemv.Gemv, w: torch.Tensor, b: torch.Tensor | None,
                     out_norm: torch.Tensor | None, eps: float
                     ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """_output_add on the GEMV: the add into the residual stream in the kernel, or (Gemma's
    output norms) GEMV, norm, add."""
    if out_norm is None:
        op = g.bind(w, b, gemv.MODE_ADD)
        return lambda x, r: op(x, r)
    op = g.bind(w, b)
    return lambda x, r: r.add_(rms_norm(op(x), out_norm, eps))


def _apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos_sin [T, D] (cos | sin halves); returns a new tensor."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1 = out[..., :half]
    o2 = out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class CausalLM(nn.Module):
    """Parameters are allocated uninitialised; `kvserve.model.loader.load_model` fills them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        p = dict(dtype=dtype, device=device)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, **p)
        self.layers = nn.ModuleList(self.make_layer(config, i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = _param(config.hidden_size, **p)
        self.lm_head = None if config.tie_word_embeddings else \
            _param(config.vocab_size, config.hidden_size, **p)
        self.register_buffer("rope_cos_sin", rope_cache(config, device), persistent=False)
        # Layers whose RoPE differs from the full layers' (Gemma 3's local layers) use a second
        # table; layer i uses table self._rope_of_layer[i].
        self._rope_of_layer = [0] * config.num_hidden_layers
        local = None
        if config.sliding_rope_theta is not None:
            local = rope_cache(config, device, config.sliding_rope_theta,
                               config.sliding_rope_scaling)
            self._rope_of_layer = [int(w is not None) for w in config.windows]
        self.register_buffer("rope_cos_sin_local", local, persistent=False)
        # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype as transformers
        # scales them; a buffer, built once and moved with the model, not a tensor per forward.
        self.register_buffer("embed_scale", None if config.embed_scale is None else
                             torch.tensor(config.embed_scale, dtype=dtype, device=device),
                             persistent=False)
        self._softcap = config.final_logit_softcapping
        self.packed = False  # whether any GEMM runs on oneDNN-packed weights
        self.gemm_plan: GemmPlan | None = None  # set by pack_weights
        # per gemm_select bucket: (GEMM function, weight) of the LM head
        self._head_ops: list[tuple[Callable, torch.Tensor]] = []
        self._fast_decode: FastDecode | None = None  # set by apply_gemm_plan where it applies
        self._norm = rms_norm

    def make_layer(self, config: ModelConfig, index: int, dtype: torch.dtype,
                   device: torch.device | str | None) -> nn.Module:
        """One decoder layer; an architecture with its own layers (DeepSeek's MLA and MoE,
        `kvserve.model.deepseek`) overrides this and keeps the rest of the model."""
        return DecoderLayer(config, index, dtype, device)

    def pack_weights(self, kernel: str = "auto", remeasure: bool = False) -> bool:
        """Choose the GEMM kernel of every projection and the LM head per row bucket and
        re-lay the weights out for it (gemm_select.py); returns whether any weight now runs
        through oneDNN. Call once, after the weights are loaded: packed weights can no longer
        be sliced or copied into.

        kernel: "auto" measures in float32 (or reads the cached measurement for this CPU and
        shapes) and packs everything in other dtypes, "onednn" packs everything, "dense"
        packs nothing, "gemv" runs the C++ GEMV in the first row bucket and dense elsewhere,
        "panel" the panel GEMM above the first bucket (panel_gemm.py, float32). On a build
        or dtype oneDNN cannot pack, "onednn" stays dense (and "auto" chooses between dense
        and the C++ kernels); without a compiler "gemv" and "panel" stay dense. With tied
        embeddings a oneDNN or panel LM head needs a packed copy of the embedding table
        (vocab_size x hidden_size more memory, each). `remeasure`: "auto" measures again
        rather than reading the cache (gemm_select.choose)."""
        if self.gemm_plan is not None:
            return self.packed
        if kernel not in ("auto", *gemm_select.KERNELS):
            raise ValueError(f"GEMM kernel must be 'auto' or one of {gemm_select.KERNELS}, "
                             f"got {kernel!r}")
        device = self.embed_tokens.device
        if device.type != "cpu" or not self.layers:
            return False
        onednn = onednn_available(self.dtype, device)
        has_gemv = gemv_available(self.dtype, device)
        has_panel = panel_gemm.available(self.dtype, device)
        if (kernel == "onednn" and not onednn) or (kernel == "gemv" and not has_gemv) or \
                (kernel == "panel" and not has_panel):
            kernel = "dense"
        elif kernel == "auto" and self.dtype != torch.float32:
            # F.linear in bf16/fp16 is itself an unpacked oneDNN call, compiled per row count
            # (unbounded kernel cache, docs/soak.md): packed oneDNN is both faster and bounded.
            kernel = "onednn" if onednn else "dense"
        elif kernel == "auto" and not (onednn or has_gemv or has_panel):
            kernel = "dense"  # nothing to choose between
        plan = gemm_select.forced_plan(kernel) if kernel != "auto" \
            else self._measure_gemms(remeasure)
        return self.apply_gemm_plan(plan)

    def apply_gemm_plan(self, plan: GemmPlan) -> bool:
        """Re-lay the weights out as `plan` says and bind its kernels (see pack_weights)."""
        if any(plan.uses(p, "onednn") for p in (*_PROJS, "head")) and \
                not onednn_available(self.dtype, self.embed_tokens.device):
            raise ValueError(f"oneDNN cannot pack {self.dtype} weights on this machine")
        if any(plan.uses(p, "gemv") for p in (*_PROJS, "head")) and \
                not gemv_available(self.dtype, self.embed_tokens.device):
            raise ValueError(f"the C++ GEMV kernel cannot run {self.dtype} weights here")
        if any(plan.uses(p, "panel") for p in (*_PROJS, "head")) and \
                not panel_gemm.available(self.dtype, self.embed_tokens.device):
            raise ValueError(f"the panel GEMM kernel cannot run {self.dtype} weights here")
        for layer in self.layers:
            layer.set_gemm_plan(plan)
        head_dense = self.lm_head if self.lm_head is not None else self.embed_tokens
        head_packed = _onednn_pack(head_dense) if plan.uses("head", "onednn") else None
        if self.lm_head is not None and \
                not any(plan.uses("head", k) for k in gemm_select.ROW_MAJOR):
            self.lm_head = None  # the packed copy is the head now
        head_gemv = gemv.load().bind(head_dense) if plan.uses("head", "gemv") else None
        head_panel = panel_gemm.load().bind(panel_gemm.load().pack(head_dense)) \
            if plan.uses("head", "panel") else None
        by_kernel = {"onednn": (_onednn_linear, head_packed), "dense": (_dense_linear, head_dense),
                     "gemv": (lambda x, w, b: head_gemv(x), head_dense),
                     "panel": (_panel_linear, head_panel)}
        self._head_ops = [by_kernel[k] for k in plan.kernels["head"]]
        if gemv_available(self.dtype, self.embed_tokens.device):
            self._norm = gemv.load().rms_norm  # the final norm too (see _attn_in_unfused)
        ops = [getattr(layer, "fast_decode_ops", None) for layer in self.layers]
        self._fast_decode = None
        if all(op is not None for op in ops) and len(set(self._rope_of_layer)) == 1:
            c = self.config
            self._fast_decode = FastDecode(ops, c.num_attention_heads, c.num_key_value_heads,
                                           self.layers[0].head_dim)
        self.gemm_plan = plan
        self.packed = any("onednn" in ks for ks in plan.kernels.values())
        if plan.source != "forced":
            logger.info("GEMM kernels (%s; %s, %s, %d threads; row buckets %s): %s",
                        plan.source, cpu_info().model_name, str(self.dtype).split(".")[-1],
                        torch.get_num_threads(), "/".join(gemm_select.BUCKET_LABELS),
                        plan.describe())
        return self.packed

    def gemm_candidates(self, layer_ops: bool = True
                        ) -> dict[str, dict[str, gemm_select.RunFactory]]:
        """projection -> kernel -> factory(rows) -> run-once callable, on layer 0's weights
        and the LM head (oneDNN-packed copies made here): what `gemm_select` times, and what
        benchmarks time for the machine's GEMM ceiling (`layer_ops`: see
        DecoderLayer.gemm_candidates). Needs the dense weights (before
        `pack_weights`, or with kernel "dense")."""
        h = self.config.hidden_size
        factories = self.layers[0].gemm_candidates(layer_ops)
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        # made at a factory's first call; the C++ ones bound once, as apply_gemm_plan binds
        # them (the checked call costs ~10 us more)
        makers = {"onednn": lambda: _onednn_pack(head), "gemv": lambda: gemv.load().bind(head),
                  "panel": lambda: panel_gemm.load().bind(panel_gemm.load().pack(head))}
        made: dict[str, Callable] = {}
        p = {"dtype": self.dtype, "device": head.device}

        def head_run(kind: str) -> gemm_select.RunFactory:
            def make(rows: int) -> Callable[[], object] | None:
                if not gemm_select.offered(kind, gemm_select.bucket_of(rows)):
                    return None
                if kind in makers and kind not in made:
                    made[kind] = makers[kind]()
                x = torch.randn(rows, h, **p)
                if kind == "onednn":
                    return lambda: _onednn_linear(x, made[kind], None)
                if kind in ("gemv", "panel"):
                    return lambda: made[kind](x)
                return lambda: _dense_linear(x, head, None)
            return make

        factories["head"] = {k: head_run(k) for k in factories["qkv"]}
        return factories

    def _measure_gemms(self, remeasure: bool = False) -> GemmPlan:
        """Time the candidates on layer 0's weights and the LM head (or read the cache)."""
        c = self.config
        h = c.hidden_size
        shapes = {"qkv": (c.q_size + 2 * c.kv_size, h), "o": (h, c.q_size),
                  "mlp": (2 * c.intermediate_size, h), "down": (h, c.intermediate_size),
                  "head": (c.vocab_size, h)}
        return gemm_select.model_plan(self.gemm_candidates, shapes, c.num_hidden_layers,
                                      self.embed_tokens.element_size(),
                                      str(self.dtype).split(".")[-1], remeasure)

    def warm_up_gemms(self, max_rows: int, max_logit_rows: int, max_flops: float = 2e11) -> int:
        """`warm_up_steps` run to the end: how many row counts it warmed."""
        return sum(1 for _ in self.warm_up_steps(max_rows, max_logit_rows, max_flops))

    def warm_up_steps(self, max_rows: int, max_logit_rows: int, max_flops: float = 2e11
                      ) -> Iterator[int]:
        """Run each oneDNN GEMM once at every row count `gemm_rows` yields for 1..max_rows (the
        LM head up to max_logit_rows) in the buckets the GEMM plan runs through oneDNN,
        smallest first, while the FLOPs spent stay under `max_flops`, yielding each row count
        once it is warmed (nothing without packed weights; a server runs them while it has no
        request: AsyncLLMEngine.run_when_idle).

        Why: oneDNN compiles a kernel the first time it meets a shape and keeps it for the life
        of the process (about 0.7 MB each on this project's CPU). Compiling them all up front
        makes a server reach its steady memory at start-up, instead of creeping up for hours
        as rare batch sizes turn up, and no request waits on a compile. Layers with the same
        shapes share kernels, so one layer of each shape (`warm_up_layers`) is enough. (The
        dense kernels, MKL, compile nothing.)"""
        if not self.packed or not self.layers:
            return
        c = self.config
        h = c.hidden_size
        kernels = self.gemm_plan.kernels
        layers = self.warm_up_layers()
        per_row = sum(layer.gemm_flops_per_row() for layer in layers)
        zeros = dict(dtype=self.dtype, device=self.embed_tokens.device)
        spent = 0.0
        for rows in sorted({gemm_rows(t) for t in range(1, max_rows + 1)}):
            b = gemm_select.bucket_of(rows)
            head = rows <= max_logit_rows and kernels["head"][b] == "onednn"
            body = any(kernels[p][b] == "onednn" for p in _PROJS)
            if not (head or body):
                continue
            cost = rows * ((per_row if body else 0) + (2 * h * c.vocab_size if head else 0))
            if spent + cost > max_flops:
                break
            with torch.inference_mode():  # not held across a yield (it is per thread)
                x = torch.zeros(rows, h, **zeros)
                if body:
                    for layer in layers:
                        layer.warm_up_gemms(x, b)
                if head:
                    self.compute_logits(x)
            spent += cost
            yield rows

    def warm_up_layers(self) -> list[nn.Module]:
        """One layer of each distinct GEMM shape set (every DecoderLayer has the same)."""
        return [self.layers[0]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden_size]."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        tables = [self.rope_cos_sin.index_select(0, positions).to(self.dtype)]
        if self.rope_cos_sin_local is not None:
            tables.append(self.rope_cos_sin_local.index_select(0, positions).to(self.dtype))
        bucket = gemm_select.bucket_of(hidden.shape[0])
        if bucket == 0 and self._fast_decode is not None \
                and self._fast_decode.run(hidden, tables[self._rope_of_layer[0]],
                                          attn) is not None:
            return self._norm(hidden, self.norm, self.config.rms_norm_eps)
        for layer, rope in zip(self.layers, self._rope_of_layer):
            hidden = layer(hidden, tables[rope], attn, bucket)
        return self._norm(hidden, self.norm, self.config.rms_norm_eps)

    def use_triton_ops(self) -> None:
        """Switch every layer to the fused Triton element-wise kernels (see DecoderLayer)."""
        from kvserve.kernels.gpu import ops as gpu_ops

        for layer in self.layers:
            layer.use_triton_ops()
        self._norm = gpu_ops.rms_norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        if self._head_ops:
            fn, weight = self._head_ops[gemm_select.bucket_of(hidden.shape[0])]
        else:
            fn, weight = _dense_linear, self.lm_head if self.lm_head is not None \
                else self.embed_tokens
        logits = fn(hidden, weight, None).float()
        if self._softcap is not None:
            logits = logits.div_(self._softcap).tanh_().mul_(self._softcap)
        return logits
