"""Mixtral (`MixtralForCausalLM`): Mistral's attention with routed experts in place of every
MLP, as transformers' modeling_mixtral.py computes them: a router
(`block_sparse_moe.gate`) scores `num_local_experts` experts with a softmax, each token takes
its `num_experts_per_tok` best with their weights normalised to sum to 1; each expert is a
SwiGLU of width `intermediate_size` (`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2`
down). No biases; a `sliding_window` is read by the shared `layer_windows`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.deepseek_config import MoEConfig
from kvserve.models.fields import llama_fields, pos_int
from kvserve.models.weights import Layout, decoder_weights

_LAYOUT = Layout(moe_block="block_sparse_moe", experts=("w1", "w3", "w2"))


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = llama_fields(d, arch, max_positions=131072, eps=1e-5, mlp_bias=False)
    experts, top_k = pos_int(d, "num_local_experts"), pos_int(d, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) exceeds num_local_experts "
                         f"({experts})")
    f["moe"] = MoEConfig(n_routed_experts=experts, num_experts_per_tok=top_k,
                         moe_intermediate_size=f["intermediate_size"], n_shared_experts=0,
                         first_k_dense_replace=0, scoring="softmax", topk_method="greedy",
                         norm_topk_prob=True)
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, _LAYOUT)


MIXTRAL = Family(config=_config, model=decoder_model, weights=_weights,
                 make_config=partial(transformers_config, "MixtralConfig", num_local_experts=4,
                                     num_experts_per_tok=2))
