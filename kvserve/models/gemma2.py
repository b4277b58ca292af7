"""Gemma 2 (`Gemma2ForCausalLM`): Gemma 3's decoder without q/k norms, with one RoPE and
attention logit soft-capping, as transformers' modeling_gemma2.py computes it: embeddings times
sqrt(hidden_size); (1 + weight) RMSNorms before and after attention and the MLP (Gemma 3's
layout, `gemma3._LAYOUT`); a GELU-tanh gate; the softmax scale from `query_pre_attn_scalar`;
the attention scores soft-capped by `attn_logit_softcapping` (the attention backend's
`softcap`) and the final logits by `final_logit_softcapping`; every other layer sliding
(`layer_types`, or even layers without it: the shared `layer_windows`).
"""

from __future__ import annotations

from typing import Any

from kvserve.models import gemma3
from kvserve.models.base import Family, decoder_model, transformers_config
from kvserve.models.fields import (decoder_fields, gated_activation, opt_pos_float, pos_float,
                                   rope_fields)
from kvserve.models.weights import decoder_weights


def _config(d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=8192, head_dim=256)
    f["hidden_act"] = gated_activation(d, arch, "hidden_activation", gemma3.GELU_TANH)
    f.update(rope_fields(d, f["max_position_embeddings"]))
    bias = bool(d.get("attention_bias", False))
    f.update(attention_bias=bias, o_proj_bias=bias, output_norms=True,
             embed_scale=f["hidden_size"] ** 0.5,
             query_pre_attn_scalar=pos_float(d, "query_pre_attn_scalar", 256.0),
             final_logit_softcapping=opt_pos_float(d, "final_logit_softcapping"),
             attn_logit_softcapping=opt_pos_float(d, "attn_logit_softcapping"))
    f["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, gemma3._LAYOUT)


def _make_config(size: str, shape: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Gemma2Config's, with head_dim hidden / heads (its default is 256) and the query scale
    from it, as the 2B and 9B models have it (and llama.cpp assumes for a GGUF of them)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return transformers_config("Gemma2Config", size, shape, common, head_dim=head_dim,
                               query_pre_attn_scalar=head_dim, sliding_window=64,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


GEMMA2 = Family(config=_config, model=decoder_model, weights=_weights, make_config=_make_config)
