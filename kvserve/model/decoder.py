"""One config-driven decoder for Llama, Qwen2, Qwen3, Mistral and Gemma 3 (text).

Gemma 3 is the same decoder with a few switches from its config: embeddings scaled by
sqrt(hidden_size), norms that scale by (1 + weight) (the loader stores 1 + weight, so the norm
code is shared), the attention and MLP outputs normed before their residual adds, per-head q/k
norms (as Qwen3), a GELU-tanh gate, the attention scale from `query_pre_attn_scalar`, a RoPE base
per layer type (local and global layers), and tanh soft-capping of the final logits.

The model runs on a flat batch: `T` new tokens from any number of sequences, with no batch
dimension and no padding. Everything that depends on which sequence a token belongs to (the
KV cache, masks) lives behind the `AttentionFn` the caller passes in.

Layout, chosen for the CPU hot path:
  * q, k and v projections are one matrix `qkv_proj` ([q; k; v] rows), gate and up are one
    matrix `gate_up_proj` ([gate; up] rows), so each layer runs four GEMMs;
  * the residual add is folded into the o_proj and down_proj GEMMs (`addmm_` with beta=1 writes
    straight into the residual stream, or oneDNN's "add" post-op, below);
  * RoPE uses Hugging Face's rotate-half convention (the first half of each head pairs with the
    second half), with cos/sin precomputed once in float32 and gathered once per step;
  * on x86 CPUs `CausalLM.pack_weights()` (called by the loader) re-lays the four projection
    matrices and the LM head out in oneDNN's blocked format and routes the GEMMs through
    oneDNN, with the residual add as a fused post-op. On this project's reference CPU (AMD
    Zen 5, 2 threads) that runs the projections about 2x faster than `F.linear` (MKL, which
    does not use AVX-512 fully on AMD) in float32; in bfloat16 `F.linear` already goes through
    oneDNN and packing gains 10-30%.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention.base import AttentionFn
from kvserve.model.config import ModelConfig


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    # torch.empty does not initialise: the loader fills every parameter.
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
    the config's (full layers') RoPE unless `theta` (and `scaling`) are given."""
    dim = config.head_dim
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
    """The row count a oneDNN GEMM of `t` rows runs with: `t` up to 16, else `t` rounded up to
    one of 8 sizes per doubling (at most 12.5% padding).

    Why: oneDNN JIT-compiles a primitive for every distinct input shape and keeps it in two LRU
    caches of 1,024 entries each (its primitive cache and ideep's), at ~0.7 MB apiece on this
    project's CPU. A server's steps carry every token count from 1 to max_num_batched_tokens,
    so with exact shapes most steps compiled new kernels and RSS grew by ~12 MB per round of
    256 concurrent requests (see docs/soak.md). With these sizes there are 88 row counts up to
    8,192 (5 GEMMs each, plus the LM head's), which all stay cached."""
    if t <= 16:
        return t
    step = 1 << (t.bit_length() - 4)
    return -(-t // step) * step


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (a copy)."""
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    out[x.shape[0]:].zero_()
    return out


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    t = x.shape[0]
    rows = gemm_rows(t)
    if rows != t:
        return torch.ops.mkldnn._linear_pointwise(_pad_rows(x, rows), w, b, "none", [], "")[:t]
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                       b: torch.Tensor | None) -> torch.Tensor:
    t = x.shape[0]
    rows = gemm_rows(t)
    if rows != t:
        return torch.ops.mkldnn._linear_pointwise.binary(
            _pad_rows(x, rows), _pad_rows(residual, rows), w, b, "add")[:t]
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, b, "add")


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
        self.input_layernorm = _param(h, **p)
        self.qkv_proj = _param(qkv, h, **p)
        self.qkv_bias = _param(qkv, **p) if c.attention_bias else None
        # Qwen3: q_norm repeated over the q heads, then k_norm over the kv heads, so that one
        # normalisation covers q and k together.
        self.qk_norm = _param(c.num_attention_heads + c.num_key_value_heads, c.head_dim, **p) \
            if c.qk_norm else None
        self.o_proj = _param(h, c.q_size, **p)
        self.o_bias = _param(h, **p) if c.o_proj_bias else None
        # The norm before the MLP (Llama's post_attention_layernorm, Gemma's
        # pre_feedforward_layernorm).
        self.post_attention_layernorm = _param(h, **p)
        # Gemma 3: norms of the attention and MLP outputs, before their residual adds.
        self.attn_out_norm = _param(h, **p) if c.gemma_norms else None
        self.mlp_out_norm = _param(h, **p) if c.gemma_norms else None
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = _param(2 * c.intermediate_size, h, **p)
        self.gate_up_bias = _param(2 * c.intermediate_size, **p) if c.mlp_bias else None
        self.down_proj = _param(h, c.intermediate_size, **p)
        self.down_bias = _param(h, **p) if c.mlp_bias else None
        self._linear = _dense_linear
        self._linear_add = _dense_linear_add
        self._norm = rms_norm
        self._rope = _apply_rope

    def use_triton_ops(self) -> None:
        """Fused Triton RMSNorm / RoPE / SiLU-and-mul (`kvserve.model.gpu_ops`): the GPU path,
        where each PyTorch element-wise op is a kernel launch. Not with oneDNN-packed weights."""
        from kvserve.model import gpu_ops

        self._norm = gpu_ops.rms_norm
        self._rope = gpu_ops.apply_rope
        if self.gate_up_proj is not None and not self.gelu:
            self._swiglu = self._swiglu_triton

    def _swiglu_triton(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.model import gpu_ops

        return gpu_ops.silu_mul(self._linear(x, self.gate_up_proj, self.gate_up_bias))

    def pack_weights(self) -> None:
        """Replace the projection matrices by oneDNN-packed copies (frees the dense ones).

        Gate and up are packed apart: SiLU then runs as the gate GEMM's epilogue and the product
        as the up GEMM's, which saves two passes over the [T, intermediate] activations (the
        SwiGLU element-wise work was ~12% of a decode step).
        """
        for name in ("qkv_proj", "o_proj", "down_proj"):
            setattr(self, name, nn.Parameter(_onednn_pack(getattr(self, name)),
                                             requires_grad=False))
        i = self.intermediate_size
        gate, up = self.gate_up_proj[:i], self.gate_up_proj[i:]
        self.gate_proj = nn.Parameter(_onednn_pack(gate), requires_grad=False)
        self.up_proj = nn.Parameter(_onednn_pack(up), requires_grad=False)
        bias = self.gate_up_bias
        self.gate_bias = None if bias is None else bias[:i].contiguous()
        self.up_bias = None if bias is None else bias[i:].contiguous()
        del self.gate_up_proj
        self.gate_up_proj = None
        self._linear = _onednn_linear
        self._linear_add = _onednn_linear_add
        self._swiglu = self._geglu_packed if self.gelu else self._swiglu_fused

    def gemm_flops_per_row(self) -> int:
        """FLOPs of this layer's projections per token (for the warm-up's budget)."""
        h = self.input_layernorm.shape[0]
        qkv = self.q_size + 2 * self.num_kv_heads * self.head_dim
        return 2 * (h * qkv + self.q_size * h + 3 * h * self.intermediate_size)

    def warm_up_gemms(self, x: torch.Tensor) -> None:
        """Run each projection once on zeros x [rows, hidden] (compiles its oneDNN kernel)."""
        self._linear(x, self.qkv_proj, self.qkv_bias)
        zeros = torch.zeros(x.shape[0], self.q_size, dtype=x.dtype, device=x.device)
        self._linear_add(zeros, x.clone(), self.o_proj, self.o_bias)
        self._linear_add(self._swiglu(x), x.clone(), self.down_proj, self.down_bias)

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """hidden [T, hidden_size] is the residual stream; it may be updated in place."""
        t = hidden.shape[0]
        d = self.head_dim
        x = self._norm(hidden, self.input_layernorm, self.eps)
        qkv = self._linear(x, self.qkv_proj, self.qkv_bias)
        qk = qkv[:, : self.qk_size].view(t, self.num_heads + self.num_kv_heads, d)
        if self.qk_norm is not None:
            qk = self._norm(qk, self.qk_norm, self.eps)  # per-head weight [heads, D]
        qk = self._rope(qk, cos_sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.qk_size:].view(t, self.num_kv_heads, d)
        o = attn(self.layer_idx, q, k, v).reshape(t, self.q_size)
        if self.attn_out_norm is None:
            hidden = self._linear_add(o, hidden, self.o_proj, self.o_bias)
        else:
            o = self._linear(o, self.o_proj, self.o_bias)
            hidden = hidden.add_(self._norm(o, self.attn_out_norm, self.eps))

        x = self._norm(hidden, self.post_attention_layernorm, self.eps)
        if self.mlp_out_norm is None:
            return self._linear_add(self._swiglu(x), hidden, self.down_proj, self.down_bias)
        m = self._linear(self._swiglu(x), self.down_proj, self.down_bias)
        return hidden.add_(self._norm(m, self.mlp_out_norm, self.eps))

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation(gate) * up (SiLU, or Gemma's GELU-tanh)."""
        gate_up = self._linear(x, self.gate_up_proj, self.gate_up_bias)
        gate = gate_up[:, : self.intermediate_size]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return act.mul_(gate_up[:, self.intermediate_size:])

    def _geglu_packed(self, x: torch.Tensor) -> torch.Tensor:
        gate = _onednn_linear(x, self.gate_proj, self.gate_bias)
        return F.gelu(gate, approximate="tanh").mul_(_onednn_linear(x, self.up_proj,
                                                                    self.up_bias))

    def _swiglu_fused(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        rows = gemm_rows(t)  # a few cached GEMM shapes, not one per token count
        if rows != t:
            x = _pad_rows(x, rows)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate_proj, self.gate_bias, "swish",
                                                  [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up_proj, self.up_bias,
                                                         "mul")[:t]


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
        self._embed_scale = config.embed_scale
        self._softcap = config.final_logit_softcapping
        self.packed = False
        self._logits_linear = _dense_linear
        self._norm = rms_norm
        # With tied embeddings and packing: a packed copy of the embedding table for the head.
        self.register_buffer("_packed_head", None, persistent=False)

    def make_layer(self, config: ModelConfig, index: int, dtype: torch.dtype,
                   device: torch.device | str | None) -> nn.Module:
        """One decoder layer; an architecture with its own layers (DeepSeek's MLA and MoE,
        `kvserve.model.deepseek`) overrides this and keeps the rest of the model."""
        return DecoderLayer(config, index, dtype, device)

    def pack_weights(self) -> bool:
        """Switch the projections and the LM head to oneDNN-packed weights when this build and
        CPU support it for the model's dtype; returns whether it did. Call once, after the
        weights are loaded: packed weights can no longer be sliced or copied into.

        Memory stays the same except with tied embeddings: the lookup needs the dense table, so
        the head gets a packed copy (vocab_size x hidden_size more), which runs the LM head
        about 1.4x faster than oneDNN on the dense table and 3x faster than `F.linear`."""
        if self.packed:
            return True
        if not onednn_available(self.dtype, self.embed_tokens.device):
            return False
        for layer in self.layers:
            layer.pack_weights()
        if self.lm_head is not None:
            self.lm_head = nn.Parameter(_onednn_pack(self.lm_head), requires_grad=False)
        else:
            self._packed_head = _onednn_pack(self.embed_tokens)
        self._logits_linear = _onednn_linear
        self.packed = True
        return True

    def warm_up_gemms(self, max_rows: int, max_logit_rows: int, max_flops: float = 2e11) -> int:
        """Run each packed GEMM once at every row count `gemm_rows` yields for 1..max_rows (the
        LM head up to max_logit_rows), smallest first, while the FLOPs spent stay under
        `max_flops`; returns how many row counts were warmed (0 without packed weights).

        Why: oneDNN compiles a kernel the first time it meets a shape and keeps it for the life
        of the process (about 0.7 MB each on this project's CPU). Compiling them all before
        serving makes a server reach its steady memory at start-up, instead of creeping up for
        hours as rare batch sizes turn up, and no request waits on a compile. Layers with the
        same shapes share kernels, so one layer of each shape (`warm_up_layers`) is enough."""
        if not self.packed or not self.layers:
            return 0
        c = self.config
        h = c.hidden_size
        layers = self.warm_up_layers()
        per_row = sum(layer.gemm_flops_per_row() for layer in layers)
        zeros = dict(dtype=self.dtype, device=self.embed_tokens.device)
        spent, warmed = 0.0, 0
        with torch.inference_mode():
            for rows in sorted({gemm_rows(t) for t in range(1, max_rows + 1)}):
                cost = rows * (per_row + (2 * h * c.vocab_size if rows <= max_logit_rows else 0))
                if spent + cost > max_flops:
                    break
                x = torch.zeros(rows, h, **zeros)
                for layer in layers:
                    layer.warm_up_gemms(x)
                if rows <= max_logit_rows:
                    self.compute_logits(x)
                spent += cost
                warmed += 1
        return warmed

    def warm_up_layers(self) -> list[nn.Module]:
        """One layer of each distinct GEMM shape set (every DecoderLayer has the same)."""
        return [self.layers[0]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden_size]."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self._embed_scale is not None:  # in the weights' dtype, as transformers scales
            hidden = hidden * torch.tensor(self._embed_scale, dtype=hidden.dtype)
        tables = [self.rope_cos_sin.index_select(0, positions).to(self.dtype)]
        if self.rope_cos_sin_local is not None:
            tables.append(self.rope_cos_sin_local.index_select(0, positions).to(self.dtype))
        for layer, rope in zip(self.layers, self._rope_of_layer):
            hidden = layer(hidden, tables[rope], attn)
        return self._norm(hidden, self.norm, self.config.rms_norm_eps)

    def use_triton_ops(self) -> None:
        """Switch every layer to the fused Triton element-wise kernels (see DecoderLayer)."""
        from kvserve.model import gpu_ops

        for layer in self.layers:
            layer.use_triton_ops()
        self._norm = gpu_ops.rms_norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        if self.lm_head is not None:
            weight = self.lm_head
        elif self._packed_head is not None:
            weight = self._packed_head
        else:
            weight = self.embed_tokens
        logits = self._logits_linear(hidden, weight, None).float()
        if self._softcap is not None:
            logits = logits.div_(self._softcap).tanh_().mul_(self._softcap)
        return logits
