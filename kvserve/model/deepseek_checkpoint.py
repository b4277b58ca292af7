"""Random-weight DeepSeek-V2 / V3 checkpoints in transformers' layout (`kvserve make-model --arch
deepseek_v2|deepseek_v3`): the config.json transformers 5.24 writes and tensors named as its
`save_pretrained` names them (routed experts one by one), so they load in transformers too.

tiny: V2 without q_lora (as V2-Lite), V3 with it; both MoE from layer 1 with 8 routed experts
(top 2) and a shared one. small: the benchmark's shape (8 layers, hidden 512, 16 experts).
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.model.config import ARCH_BY_MODEL_TYPE

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")
DEEPSEEK_SIZES = ("tiny", "small")
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


def deepseek_hf_config(arch: str, size: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json for a DeepSeek arch; `common` holds the keys every architecture shares
    (dtype, token ids, initializer_range, transformers_version, ...)."""
    if size not in DEEPSEEK_SIZES:
        raise ValueError(f"size for {arch} must be one of {DEEPSEEK_SIZES}, got {size!r}")
    s = dict(_SHAPES[size])
    v3 = arch == "deepseek_v3"
    config = {**common, **s,
              "architectures": [ARCH_BY_MODEL_TYPE[arch]], "model_type": arch,
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
    return dict(sorted(config.items()))


def deepseek_random_weights(config: dict[str, Any], seed: int, dtype: torch.dtype,
                            device: str = "cpu") -> dict[str, torch.Tensor]:
    """HF-named tensors: N(0, initializer_range) matrices, unit norms, in a fixed order (the
    router's weight and V3's e_score_correction_bias in float32, as transformers keeps them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.get("initializer_range", 0.02)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    r, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    q_lora = config.get("q_lora_rank")
    out: dict[str, torch.Tensor] = {}

    def normal(name: str, *shape: int, as_dtype: torch.dtype = dtype) -> None:
        out[name] = torch.empty(shape, device=device).normal_(0.0, std, generator=gen) \
            .to(as_dtype).cpu()

    def ones(name: str, n: int) -> None:
        out[name] = torch.ones(n, dtype=dtype)

    def mlp(prefix: str, inter: int) -> None:
        normal(prefix + "gate_proj.weight", inter, h)
        normal(prefix + "up_proj.weight", inter, h)
        normal(prefix + "down_proj.weight", h, inter)

    normal("model.embed_tokens.weight", config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        ones(p + "input_layernorm.weight", h)
        if q_lora:
            normal(a + "q_a_proj.weight", q_lora, h)
            ones(a + "q_a_layernorm.weight", q_lora)
            normal(a + "q_b_proj.weight", heads * (nope + rope), q_lora)
        else:
            normal(a + "q_proj.weight", heads * (nope + rope), h)
        normal(a + "kv_a_proj_with_mqa.weight", r + rope, h)
        ones(a + "kv_a_layernorm.weight", r)
        normal(a + "kv_b_proj.weight", heads * (nope + v), r)
        normal(a + "o_proj.weight", h, heads * v)
        ones(p + "post_attention_layernorm.weight", h)
        if i < config["first_k_dense_replace"]:
            mlp(p + "mlp.", config["intermediate_size"])
            continue
        experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
        normal(p + "mlp.gate.weight", experts, h, as_dtype=torch.float32)
        if config["model_type"] == "deepseek_v3":
            out[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
        for e in range(experts):
            mlp(f"{p}mlp.experts.{e}.", inter)
        mlp(p + "mlp.shared_experts.", inter * config["n_shared_experts"])
    ones("model.norm.weight", h)
    normal("lm_head.weight", config["vocab_size"], h)
    return out
