"""Gemma 3 (text, `Gemma3ForCausalLM`): the shared decoder with Gemma's switches.

As transformers computes it: embeddings times sqrt(hidden_size); RMSNorms that scale by
(1 + weight) (the weight map adds 1 to every norm weight, so the decoder's one norm serves);
norms both before and after attention and the MLP (`pre_norms` and `output_norms`: the
checkpoint's post_attention_layernorm is the attention output's norm, pre_feedforward_layernorm
the MLP input's); per-head q/k norms; a GELU-tanh gate; the softmax scale from
`query_pre_attn_scalar`; a RoPE per layer type (local layers 10,000, global 1,000,000, read from
transformers 5's per-layer-type `rope_parameters` or the older `rope_local_base_freq`); five
sliding layers to one global (`layer_windows`); tanh soft-capping of the final logits.
"""

from __future__ import annotations

from typing import Any

from kvserve.models.base import Family, decoder_model
from kvserve.models.fields import (decoder_fields, gated_activation, opt_pos_float, pos_float,
                                   rope_fields)
from kvserve.models.weights import Layout, decoder_weights

GELU_TANH = "gelu_pytorch_tanh"
_LAYOUT = Layout(norms={"input_layernorm": "input_layernorm",
                        "attn_out_norm": "post_attention_layernorm",
                        "post_attention_layernorm": "pre_feedforward_layernorm",
                        "mlp_out_norm": "post_feedforward_layernorm"},
                 norm_offset=1.0)
# Gemma 3's hybrid layout: five sliding layers to one global, a window per size (the real
# models' 1,024 would cover a tiny model's whole test prompts).
PATTERN = 6
_WINDOW = {"tiny": 64, "small": 512}


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=131072, head_dim=256)
    f["hidden_act"] = gated_activation(d, arch, "hidden_activation", GELU_TANH)
    _refuse_options(d)
    (theta, scaling), local_theta = _rope(d, f["max_position_embeddings"])
    bias = bool(d.get("attention_bias", False))
    f.update(rope_theta=theta, rope_scaling=scaling, sliding_rope_theta=local_theta,
             attention_bias=bias, o_proj_bias=bias,
             qk_norm=True, output_norms=True, embed_scale=f["hidden_size"] ** 0.5,
             query_pre_attn_scalar=pos_float(d, "query_pre_attn_scalar", 256.0),
             final_logit_softcapping=opt_pos_float(d, "final_logit_softcapping"))
    return f


def _refuse_options(d: dict[str, Any]) -> None:
    """Gemma 3 options the engine does not run, refused rather than silently computed wrong."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it "
                         "null; transformers' SDPA path ignores it too)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: kvserve serves causal "
                         "decoders")


def _rope(d: dict[str, Any], max_pos: int
          ) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """Gemma 3's two RoPEs: (the full layers' base and scaling, the sliding layers' base:
    they are never scaled), from transformers 5's per-layer-type
    `rope_parameters` or the older `rope_theta` / `rope_scaling` (global) +
    `rope_local_base_freq` (local). Defaults as Gemma3TextConfig: 1e6 globally, 1e4 locally."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params
                                     or "sliding_attention" in params):
        full = rope_fields({"rope_parameters": params.get("full_attention") or {}}, max_pos, 1e6)
        local = rope_fields({"rope_parameters": params.get("sliding_attention") or {}}, max_pos,
                            1e4)
    else:
        full = rope_fields(d, max_pos, 1e6)
        local = {"rope_theta": pos_float(d, "rope_local_base_freq", 1e4), "rope_scaling": None}
    if local["rope_scaling"] is not None:
        raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
    return (full["rope_theta"], full["rope_scaling"]), local["rope_theta"]


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, _LAYOUT)


def _make_config(size: str, shape: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    s = dict(shape)
    head_dim = s.pop("head_dim", s["hidden_size"] // s["num_attention_heads"])
    tied = s.pop("tie_word_embeddings", True)
    if size == "tiny":
        s["num_hidden_layers"] = PATTERN  # one whole local/global period
    layers = s["num_hidden_layers"]
    out = {**common, **s,
           "attention_bias": False, "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "head_dim": head_dim,
           "hidden_activation": GELU_TANH,
           "layer_types": ["sliding_attention" if (i + 1) % PATTERN else "full_attention"
                           for i in range(layers)],
           "query_pre_attn_scalar": head_dim,
           "rope_parameters": {
               "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
           "sliding_window": _WINDOW.get(size, 1024), "tie_word_embeddings": tied,
           "use_bidirectional_attention": False}
    out.pop("hidden_act", None)
    return out


GEMMA3 = Family(config=_config, model=decoder_model, weights=_weights, make_config=_make_config)
