"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms per head before RoPE) with
routed experts in place of the MLP, as transformers' modeling_qwen3_moe.py computes them: a
router (`mlp.gate`) scores `num_experts` (`num_local_experts`) experts with a softmax, each
token takes its `num_experts_per_tok` best, their weights normalised to sum to 1 where
`norm_topk_prob`;
each expert is a SwiGLU of width `moe_intermediate_size` (`mlp.experts.{e}.gate_proj /
up_proj / down_proj`). Layers in `mlp_only_layers`, and all but every `decoder_sparse_step`-th,
keep a dense MLP of `intermediate_size`. No shared experts; biases on q, k, v and o follow
`attention_bias`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.deepseek_config import MoEConfig
from kvserve.models.fields import llama_fields, pos_int
from kvserve.models.weights import Layout, decoder_weights


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = llama_fields(d, arch, max_positions=32768, mlp_bias=False)
    f["qk_norm"] = True
    layers = f["num_hidden_layers"]
    # (transformers 5 writes num_local_experts, earlier versions and the Hub's num_experts)
    key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    experts, top_k = pos_int(d, key), pos_int(d, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
    step = pos_int({"decoder_sparse_step": d.get("decoder_sparse_step", 1)},
                   "decoder_sparse_step")
    only = set(d.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    f["moe"] = MoEConfig(n_routed_experts=experts, num_experts_per_tok=top_k,
                         moe_intermediate_size=pos_int(d, "moe_intermediate_size"),
                         n_shared_experts=0, first_k_dense_replace=0, scoring="softmax",
                         topk_method="greedy", norm_topk_prob=bool(d.get("norm_topk_prob")),
                         dense_layers=dense)
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, Layout())


QWEN3_MOE = Family(config=_config, model=decoder_model, weights=_weights,
                   make_config=partial(transformers_config, "Qwen3MoeConfig", num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=64,
                                       norm_topk_prob=True))
