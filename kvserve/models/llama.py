"""The Llama family: Llama, Qwen2, Qwen3 and Mistral, one pre-norm decoder with four sets of
defaults.

What differs, as transformers implements each:
  * biases: Llama's `attention_bias` puts one on q, k, v and o (and `mlp_bias` on the MLP);
    Qwen2 always has q/k/v biases and never an o_proj one; Qwen3 reads `attention_bias` as
    Llama does; Mistral has none;
  * Qwen3 norms q and k per head before RoPE, and its head_dim defaults to 128 when the key
    is absent (the others derive it from hidden_size / num_attention_heads);
  * the context length transformers assumes when `max_position_embeddings` is absent.
Sliding windows (Mistral's, Qwen's `use_sliding_window`) are read by the shared
`layer_windows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from kvserve.models.base import Family, decoder_model
from kvserve.models.fields import decoder_fields, gated_activation, rope_fields
from kvserve.models.weights import Layout, decoder_weights


@dataclass(frozen=True)
class _Variant:
    max_positions: int  # transformers' default max_position_embeddings
    qkv_bias: str  # "flag" (attention_bias: q, k, v and o), "always" (q, k, v), "never"
    mlp_bias: bool = False  # reads `mlp_bias`
    qk_norm: bool = False
    head_dim: int | None = None  # default when the key is absent


def _config(v: _Variant, d: dict[str, Any], arch: str) -> dict[str, Any]:
    f = decoder_fields(d, arch, max_positions=v.max_positions, head_dim=v.head_dim)
    f["hidden_act"] = gated_activation(d, arch)
    f.update(rope_fields(d, f["max_position_embeddings"]))
    if v.qkv_bias == "flag":
        f["attention_bias"] = f["o_proj_bias"] = bool(d.get("attention_bias", False))
    else:
        f["attention_bias"], f["o_proj_bias"] = v.qkv_bias == "always", False
    f["mlp_bias"] = v.mlp_bias and bool(d.get("mlp_bias", False))
    f["qk_norm"] = v.qk_norm
    return f


def _weights(model: Any, config: Any) -> dict:
    return decoder_weights(model, config, Layout())


def _make_config(model_type: str, size: str, shape: dict[str, Any],
                 common: dict[str, Any]) -> dict[str, Any]:
    """The config.json transformers 5.24 writes for this model_type and shape (`shape` may
    carry head_dim and tie_word_embeddings; else the family's choices)."""
    s = dict(shape)
    layers = s["num_hidden_layers"]
    head_dim = s.pop("head_dim", s["hidden_size"] // s["num_attention_heads"])
    tied = s.pop("tie_word_embeddings", None)  # None: the architecture's usual choice
    if model_type == "qwen3" and size == "tiny":
        head_dim = 32  # deliberately != hidden_size / num_attention_heads
    if model_type == "llama":
        original = s["max_position_embeddings"] // 4
        extra: dict[str, Any] = {
            "attention_bias": False, "head_dim": head_dim, "mlp_bias": False,
            "pretraining_tp": 1,
            "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": original,
                                "rope_theta": 500000.0, "rope_type": "llama3"},
            "tie_word_embeddings": False}
    elif model_type == "mistral":
        extra = {"head_dim": head_dim,
                 "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
                 "sliding_window": None,  # full attention, as kvserve computes it
                 "tie_word_embeddings": False}
    else:  # qwen2, qwen3
        extra = {"layer_types": ["full_attention"] * layers, "max_window_layers": layers,
                 "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
                 "sliding_window": None, "tie_word_embeddings": True,
                 "use_sliding_window": False}
        if model_type == "qwen3":
            extra.update(attention_bias=False, head_dim=head_dim)
        elif head_dim != s["hidden_size"] // s["num_attention_heads"]:
            extra["head_dim"] = head_dim
    if tied is not None:
        extra["tie_word_embeddings"] = tied
    return {**common, **s, **extra}


def _family(model_type: str, variant: _Variant) -> Family:
    return Family(config=partial(_config, variant), model=decoder_model, weights=_weights,
                  make_config=partial(_make_config, model_type))


LLAMA = _family("llama", _Variant(2048, "flag", mlp_bias=True))
QWEN2 = _family("qwen2", _Variant(32768, "always"))
QWEN3 = _family("qwen3", _Variant(32768, "flag", qk_norm=True, head_dim=128))
MISTRAL = _family("mistral", _Variant(131072, "never"))
