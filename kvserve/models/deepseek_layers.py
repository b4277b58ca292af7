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
import torch.nn.functional as F
from torch import nn

from kvserve.attention.mla import MLAAttentionFn, MLAProjections
from kvserve.layers.activation import gated
from kvserve.layers.linear import LinearMethod
from kvserve.layers.norm import rms_norm
from kvserve.layers.plan import ExecutionPlan
from kvserve.layers.rotary import apply_rope
from kvserve.models.config import ModelConfig
from kvserve.models.decoder import CausalLM, _param
from kvserve.models.deepseek_config import MoEConfig


class MoE(nn.Module):
    """Routed experts (top-k of `n_routed_experts`, gated as the config says) plus shared ones.

    The routed experts run grouped: the (token, expert) pairs are sorted by expert, each expert
    runs one SwiGLU over its contiguous rows, the rows are scaled by their gate weight and added
    back to their tokens. Experts use `F.linear` (MKL has no per-shape kernel cache to grow with
    the ragged row counts); the shared experts are a dense SwiGLU over every token, packed for
    oneDNN like the other projections."""

    def __init__(self, moe: MoEConfig, hidden: int, plan: ExecutionPlan) -> None:
        super().__init__()
        dtype, device = plan.dtype, plan.device
        self.cfg = moe
        e, i = moe.n_routed_experts, moe.moe_intermediate_size
        p = dict(dtype=dtype, device=device)
        # The router in float32, as transformers keeps it (`_keep_in_fp32_modules_strict`).
        self.gate = _param(e, hidden, dtype=torch.float32, device=device)
        self.e_score_correction_bias = _param(e, dtype=torch.float32, device=device) \
            if moe.scoring == "sigmoid" else None
        self.w13 = _param(e, 2 * i, hidden, **p)  # per expert [gate; up]
        self.w2 = _param(e, hidden, i, **p)
        shared = moe.n_shared_experts * i
        # (its down projection not all-reduced: `reduce` sums it with the routed experts')
        self.shared = SwiGLU(hidden, shared, plan, row=False) if shared else None
        # Tensor parallelism: each rank's experts hold some of their columns, so the routed
        # and shared sums are partial; this all-reduces them (None on one rank).
        self.reduce = plan.all_reduce()

    def prepare(self) -> None:
        if self.shared is not None:
            self.shared.prepare()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for each token."""
        c = self.cfg
        logits = F.linear(x.float(), self.gate)
        e, g = c.n_routed_experts, c.n_group
        if c.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            if c.topk_method == "group_limited_greedy":
                scores = self._mask_groups(scores, scores.view(-1, g, e // g).amax(dim=-1), 0.0)
            weights, ids = torch.topk(scores, c.num_experts_per_tok, dim=-1, sorted=False)
        else:  # DeepSeek-V3's noaux_tc
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = torch.topk(choice, c.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor,
                     fill: float) -> torch.Tensor:
        """scores with every expert outside the `topk_group` best groups set to `fill`."""
        c = self.cfg
        keep = torch.topk(group_scores, c.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(c.n_routed_experts // c.n_group, dim=1)
        return scores.masked_fill(~expert_mask, fill)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token [T, hidden]."""
        weights, ids = self.route(x)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        xs = x.index_select(0, tokens)
        out = torch.empty_like(xs)
        i = self.cfg.moe_intermediate_size
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            rows = slice(start, start + n)
            gate_up = F.linear(xs[rows], self.w13[expert])
            act = gated(gate_up, i, False)
            out[rows] = F.linear(act, self.w2[expert])
            start += n
        out.mul_(weights.flatten().index_select(0, order).to(out.dtype)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def forward_add(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + shared(x) + routed(x)."""
        if self.reduce is not None:  # one all-reduce of both partial sums
            out = self.routed(x)
            if self.shared is not None:
                out = self.shared.forward_add(x, out)
            return hidden.add_(self.reduce(out))
        if self.shared is not None:
            hidden = self.shared.forward_add(x, hidden)
        return hidden.add_(self.routed(x))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP: down(silu(gate(x)) * up(x)), added into the residual stream."""

    def __init__(self, hidden: int, intermediate: int, plan: ExecutionPlan,
                 row: bool = True) -> None:
        super().__init__()
        self.intermediate = intermediate
        p = dict(dtype=plan.dtype, device=plan.device)
        self.gate_up_proj = _param(2 * intermediate, hidden, **p)
        self.down_proj = _param(hidden, intermediate, **p)
        # how the projections run, from the plan (`row`: down all-reduced on a rank)
        self.gate_up = plan.projection(self, "gate_up_proj")
        self.down = plan.projection(self, "down_proj", row=row)

    def prepare(self) -> None:
        self.gate_up.prepare()
        self.down.prepare()

    def forward_add(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        act = gated(self.gate_up.apply(x), self.intermediate, False)
        return self.down.apply_add(act, hidden)


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
        self.qkv_a_proj = _param(self.q_a_size + m.latent_dim, hidden, **p)
        self.q_a_layernorm = _param(m.q_lora_rank, **p) if m.q_lora_rank else None
        self.q_b_proj = _param(h * m.qk_head_dim, m.q_lora_rank, **p) if m.q_lora_rank else None
        self.kv_a_layernorm = _param(m.kv_lora_rank, **p)
        self.kv_b_proj = _param(h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, **p)
        self.o_proj = _param(hidden, h * m.v_head_dim, **p)
        self.post_attention_layernorm = _param(hidden, **p)
        moe = c.moe
        if moe is not None and moe.is_moe_layer(layer_idx):
            self.mlp: MoE | SwiGLU = MoE(moe, hidden, plan)
        else:
            self.mlp = SwiGLU(hidden, c.intermediate_size, plan)
        # how the projections run, from the plan; kv_b_proj stays dense (the attention
        # backend slices it per head for absorption), and so do the routed experts
        self.qkv_a: LinearMethod = plan.projection(self, "qkv_a_proj")
        self.q_b: LinearMethod | None = None if self.q_b_proj is None \
            else plan.projection(self, "q_b_proj")
        self.o: LinearMethod = plan.projection(self, "o_proj", row=True)
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
