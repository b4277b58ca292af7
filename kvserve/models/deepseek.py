"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention and mixture-of-experts layers (`kvserve.models.deepseek_layers`), registered here.

The config adapter reads the MLA and MoE keys with `kvserve.models.deepseek_config` (the one
reader the planner shares), YaRN RoPE (DeepSeek's long-context checkpoints use it), one KV "head"
(the latent shared by every head) and head_dim = the RoPE dim, as transformers' configs define
it. The weight map takes transformers' names, routed experts one by one
(`mlp.experts.{e}.gate_proj.weight`, as save_pretrained writes them), and permutes the RoPE rows
of DeepSeek's interleaved pairs into the rotate-half layout (`deinterleave_rows`; see
`kvserve.models.deepseek_layers`). V3's multi-token-prediction module (layers numbered from
num_hidden_layers on) is left out, as transformers leaves it out.

make-model sizes: tiny (V2 without q_lora, as V2-Lite; V3 with it; both MoE from layer 1 with 8
routed experts, top 2, and a shared one) and small (the benchmark's shape: 8 layers, hidden 512,
16 experts).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvserve.models.deepseek_config import parse_mla, parse_moe
from kvserve.models.base import Family
from kvserve.models.fields import ROPE_TYPES, decoder_fields, gated_activation, rope_fields
from kvserve.models.weights import WeightMap

if TYPE_CHECKING:
    import torch

    from kvserve.models.config import ModelConfig

SIZES = ("tiny", "small")
_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=2048, max_position_embeddings=2048,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, vocab_size=32000, max_position_embeddings=8192,
                  kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                  moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1),
}


def _config(max_positions: int, d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=max_positions, kv_heads=1)
    f["hidden_act"] = gated_activation(d, arch)
    f.update(rope_fields(d, f["max_position_embeddings"], supported=ROPE_TYPES + ("yarn",)))
    mla = parse_mla(d)
    if mla is None:
        raise ValueError(f"{arch} needs a positive kv_lora_rank")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError(f"{arch} with attention_bias or mlp_bias is not supported")
    # transformers' DeepseekV2/V3Config: head_dim is the RoPE dim (it sizes the rotary
    # embedding); attention itself uses the MLA dimensions.
    f.update(head_dim=mla.qk_rope_head_dim, mla=mla, moe=parse_moe(d, f["num_hidden_layers"]))
    return f


def _model() -> type:
    from kvserve.models.deepseek_layers import DeepseekCausalLM

    return DeepseekCausalLM


def deinterleave_rows(rope_dim: int, blocks: int, block: int
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A transform for a weight whose rows are `blocks` groups of `block` rows each ending in
    `rope_dim` RoPE rows stored as interleaved pairs: those rows reordered evens first, odds
    after (see kvserve.models.deepseek_layers's docstring)."""
    import torch

    perm = torch.arange(rope_dim).view(-1, 2).t().flatten()
    index = torch.arange(blocks * block).view(blocks, block)
    index[:, block - rope_dim:] = index[:, block - rope_dim:][:, perm]
    flat = index.flatten()
    return lambda w: w.index_select(0, flat)


def _weights(model: Any, config: ModelConfig) -> dict:
    from kvserve.models.moe import MoE

    m = config.mla
    assert m is not None
    h = config.num_attention_heads
    rope_q = rope_kv = None
    if m.rope_interleave:
        rope_q = deinterleave_rows(m.qk_rope_head_dim, h, m.qk_head_dim)
        rope_kv = deinterleave_rows(m.qk_rope_head_dim, 1, m.latent_dim)
    w = WeightMap()
    w.embedding(model)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = f"{p}self_attn."
        w.norm(p + "input_layernorm.weight", layer.input_layernorm)
        q_a, kv_a = slice(0, layer.q_a_size), slice(layer.q_a_size, None)
        if m.q_lora_rank:
            w.linear(a + "q_a_proj.weight", layer.qkv_a_proj, q_a)
            w.norm(a + "q_a_layernorm.weight", layer.q_a_layernorm)
            w.linear(a + "q_b_proj.weight", layer.q_b_proj, transform=rope_q)
        else:
            w.linear(a + "q_proj.weight", layer.qkv_a_proj, q_a, transform=rope_q)
        w.linear(a + "kv_a_proj_with_mqa.weight", layer.qkv_a_proj, kv_a, transform=rope_kv)
        w.norm(a + "kv_a_layernorm.weight", layer.kv_a_layernorm)
        w.add(a + "kv_b_proj.weight", layer.kv_b_proj)
        w.linear(a + "o_proj.weight", layer.o_proj)
        w.norm(p + "post_attention_layernorm.weight", layer.post_attention_layernorm)
        mlp = layer.mlp
        if not isinstance(mlp, MoE):  # a dense SwiGLU layer
            w.gated_mlp(p + "mlp.", mlp.gate_up_proj, mlp.down_proj)
            continue
        w.add(p + "mlp.gate.weight", mlp.gate)
        if mlp.e_score_correction_bias is not None:
            w.add(p + "mlp.gate.e_score_correction_bias", mlp.e_score_correction_bias)
        for e in range(mlp.cfg.n_routed_experts):
            w.expert(f"{p}mlp.experts.{e}.", mlp.w13[e], mlp.w2[e])
        if mlp.shared is not None:
            w.gated_mlp(p + "mlp.shared_experts.", mlp.shared.gate_up_proj, mlp.shared.down_proj)
    w.final(model)
    return w.targets


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _beyond_last_layer(name: str, config: ModelConfig) -> bool:
    """V3's multi-token-prediction module: layers numbered from num_hidden_layers on."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


def _make_config(v3: bool, size: str, shape: dict[str, Any],
                 common: dict[str, Any]) -> dict[str, Any]:
    """The config.json transformers 5.24 writes (DeepSeek's own shapes per size; `shape`, the
    dense families' table entry, is not used)."""
    s = dict(_SHAPES[size])
    config = {**common, **s,
              "attention_bias": False, "head_dim": s["qk_rope_head_dim"],
              "num_key_value_heads": s["num_attention_heads"],
              "qk_head_dim": s["qk_nope_head_dim"] + s["qk_rope_head_dim"],
              "q_lora_rank": 2 * s["kv_lora_rank"] if v3 else None,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "tie_word_embeddings": False, "pretraining_tp": 1}
    if v3:
        config.update(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                      rope_interleave=True)
    else:
        config.update(mlp_bias=False, n_group=None, topk_group=None, topk_method="greedy",
                      norm_topk_prob=False, routed_scaling_factor=1.0)
    return config


DEEPSEEK_V2 = Family(config=partial(_config, 2048), model=_model, weights=_weights,
                     make_config=partial(_make_config, False), sizes=SIZES)
DEEPSEEK_V3 = Family(config=partial(_config, 4096), model=_model, weights=_weights,
                     make_config=partial(_make_config, True), skip=_beyond_last_layer,
                     sizes=SIZES)
