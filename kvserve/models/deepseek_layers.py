"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention and mixture-of-experts layers on top of `CausalLM`'s embedding, norm, RoPE table
and LM head.

Per layer, as transformers computes it:
  * attention: x -> [q_a | kv_a] in one GEMM (`qkv_a_proj`: q's low-rank down-projection, or the
    full q_proj when `q_lora_rank` is None, stacked over `kv_a_proj_with_mqa`); q = q_b_proj(
    RMSNorm(q_a)) split into nope and rope parts per head; the cached vector per token is
    [RMSNorm(latent) | RoPE(k_rope)]. The attention backend (`attention/mla.py`) stores it and
    attends, absorbed or decompressing; o_proj adds the result into the residual stream.
  * RoPE: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... The weight
    map (`kvserve.models.deepseek`, which registers these classes) permutes the RoPE rows of
    q_b_proj (or q_proj) and kv_a_proj_with_mqa to (x0, x2, ..., x1, x3, ...), after which
    the rotation is the rotate-half form every other model here uses
    (`kvserve.layers.rotary.apply_rope`); dot products between q and k are unchanged by a
    permutation applied to both, so the attention is exactly transformers'.
  * MLP: dense SwiGLU for the first `first_k_dense_replace` layers, then routed experts plus
    shared experts (`MoE`), the routed part computed with the tokens grouped by expert.
The softmax scale (1/sqrt(qk_nope + qk_rope) times YaRN's mscale^2) is
`ModelConfig.attention_scale`; the backend applies it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.mla import MLAAttentionFn, MLAProjections
from kvserve.layers.linear import LinearMethod
from kvserve.layers.norm import rms_norm
from kvserve.layers.plan import ExecutionPlan
from kvserve.layers.projection import Linear
from kvserve.layers.rotary import apply_rope
from kvserve.models.config import ModelConfig
from kvserve.models.decoder import CausalLM
from kvserve.models.moe import MoE, SwiGLU
from kvserve.layers.params import param as _param


class DeepseekLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, plan: ExecutionPlan) -> None:
        super().__init__()
        dtype, device = plan.dtype, plan.device
        c, m = config, config.mla
        assert m is not None
        self.layer_idx = layer_idx
        self.num_heads = h = c.num_attention_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        self.q_lora = m.q_lora_rank
        self.eps = c.rms_norm_eps
        p = dict(dtype=dtype, device=device)
        hidden = c.hidden_size
        self.q_a_size = m.q_lora_rank or h * m.qk_head_dim
        self.input_layernorm = _param(hidden, **p)
        self.qkv_a_proj = Linear(self.q_a_size + m.latent_dim, hidden, plan, "qkv_a_proj")
        self.q_a_layernorm = _param(m.q_lora_rank, **p) if m.q_lora_rank else None
        self.q_b_proj = Linear(h * m.qk_head_dim, m.q_lora_rank, plan, "q_b_proj") \
            if m.q_lora_rank else None
        self.kv_a_layernorm = _param(m.kv_lora_rank, **p)
        self.kv_b_proj = _param(h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, **p)
        self.o_proj = Linear(hidden, h * m.v_head_dim, plan, "o_proj")
        self.post_attention_layernorm = _param(hidden, **p)
        moe = c.moe
        if moe is not None and moe.is_moe_layer(layer_idx):
            self.mlp: MoE | SwiGLU = MoE(moe, hidden, plan)
        else:
            self.mlp = SwiGLU(hidden, c.intermediate_size, plan)
        # how the projections run, from the plan; kv_b_proj stays dense (the attention
        # backend slices it per head for absorption), and so do the routed experts
        self.qkv_a: LinearMethod = plan.projection(self.qkv_a_proj)
        self.q_b: LinearMethod | None = None if self.q_b_proj is None \
            else plan.projection(self.q_b_proj)
        self.o: LinearMethod = plan.projection(self.o_proj, row=True)
        self._proj: MLAProjections | None = None

    def process_weights_after_loading(self) -> None:
        for method in (self.qkv_a, self.q_b, self.o, self.mlp):
            if method is not None:
                method.prepare()

    @property
    def projections(self) -> MLAProjections:
        """Views of kv_b_proj per head (built once: the weights never move after loading)."""
        if self._proj is None:
            self._proj = MLAProjections.of(self.kv_b_proj, self.num_heads, self.nope, self.v_dim)
        return self._proj

    def gemm_flops_per_row(self) -> int:
        """FLOPs per token of the packed projections (routed experts run through F.linear)."""
        hidden = self.input_layernorm.shape[0]
        qk = self.num_heads * (self.nope + self.rope)
        params = hidden * (self.q_a_size + self.rank + self.rope) \
            + (self.q_lora * qk if self.q_lora else 0) + self.num_heads * self.v_dim * hidden
        mlp = self.mlp.shared if isinstance(self.mlp, MoE) else self.mlp
        if mlp is not None:
            params += 3 * hidden * mlp.intermediate
        return 2 * params

    def warm_up_gemms(self, x: torch.Tensor, bucket: int = 0) -> None:
        """Run each packed projection once on zeros x [rows, hidden] (compiles its kernel); the
        same ops serve every row bucket."""
        rows = x.shape[0]
        self.qkv_a.apply(x)
        if self.q_b is not None:
            self.q_b.apply(x.new_zeros(rows, self.q_lora))
        self.o.apply_add(x.new_zeros(rows, self.num_heads * self.v_dim), x.clone())
        mlp = self.mlp.shared if isinstance(self.mlp, MoE) else self.mlp
        if mlp is not None:
            mlp.forward_add(x, x.clone())

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor,
                attn: MLAAttentionFn, bucket: int = 0) -> torch.Tensor:
        """As DecoderLayer.forward; `bucket` is ignored (one set of ops for every row count)."""
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_layernorm, self.eps)
        a = self.qkv_a.apply(x)
        if self.q_lora:
            q_a = rms_norm(a[:, : self.q_a_size], self.q_a_layernorm, self.eps)
            q = self.q_b.apply(q_a)
        else:
            q = a[:, : self.q_a_size]
        q = q.reshape(t, self.num_heads, self.nope + self.rope)
        q_rope = apply_rope(q[..., self.nope:], cos_sin)
        latent = rms_norm(a[:, self.q_a_size: self.q_a_size + self.rank], self.kv_a_layernorm,
                          self.eps)
        k_rope = apply_rope(a[:, None, self.q_a_size + self.rank:], cos_sin)
        c = torch.cat((latent, k_rope[:, 0]), dim=-1)
        o = attn(self.layer_idx, q[..., : self.nope], q_rope, c, self.projections)
        hidden = self.o.apply_add(o.reshape(t, -1), hidden)
        x = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        return self.mlp.forward_add(x, hidden)


class DeepseekCausalLM(CausalLM):
    """`CausalLM` with DeepSeek's layers; embedding, final norm, RoPE table (the RoPE dim, with
    YaRN when configured) and LM head are the shared ones."""

    def make_layer(self, config: ModelConfig, index: int, plan: ExecutionPlan) -> nn.Module:
        return DeepseekLayer(config, index, plan)

    def warm_up_layers(self) -> list[nn.Module]:
        """The first layer (dense MLP) and the first MoE layer (shared experts): every packed
        GEMM shape the model has."""
        first_moe = next((layer for layer in self.layers if isinstance(layer.mlp, MoE)), None)
        return [self.layers[0]] + ([first_moe] if first_moe is not None else [])
