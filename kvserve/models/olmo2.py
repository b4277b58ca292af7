"""OLMo 2 (`Olmo2ForCausalLM`): a decoder whose norms sit after attention and after the MLP,
not before them, with q/k norms over the whole projection.

Differences from Llama, as transformers' modeling_olmo2.py computes them:
  * no input or pre-MLP norm: attention and the MLP read the residual stream as it is
    (`pre_norms` False), and the checkpoint's post_attention_layernorm and
    post_feedforward_layernorm norm their outputs before the residual adds (`output_norms`,
    the placement Gemma 3 uses too);
  * q_norm / k_norm: one RMSNorm over all of q (num_heads x head_dim) and one over all of k,
    before the heads are split and RoPE applied (`qk_norm_per_head` False; Qwen3's are per head);
  * `attention_bias` puts a bias on q, k, v and o; rms_norm_eps 1e-5, 2,048 positions by default.
OLMo 2's RMSNorm multiplies by its weight before casting back to the input dtype (Llama's
after); in float32 the two are the same.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.fields import decoder_fields, gated_activation, rope_fields
from kvserve.models.weights import Layout, decoder_weights

_LAYOUT = Layout(norms={"attn_out_norm": "post_attention_layernorm",
                        "mlp_out_norm": "post_feedforward_layernorm"})


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=2048, eps=1e-5)
    f["hidden_act"] = gated_activation(d, arch)
    f.update(rope_fields(d, f["max_position_embeddings"]))
    bias = bool(d.get("attention_bias", False))
    f.update(attention_bias=bias, o_proj_bias=bias, qk_norm=True, qk_norm_per_head=False,
             pre_norms=False, output_norms=True)
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, _LAYOUT)


OLMO2 = Family(config=_config, model=decoder_model, weights=_weights,
               make_config=partial(transformers_config, "Olmo2Config"))
