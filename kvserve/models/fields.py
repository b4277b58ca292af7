"""The config-adapter pieces every family shares: a Hugging Face config.json dict in, the
`ModelConfig` fields it sets out.

`decoder_fields` reads what every decoder has (sizes, heads, head_dim, norm epsilon, context
length, dtype, windows, EOS) with the family's defaults for keys a config.json may leave out
(transformers' per-class defaults); `rope_fields` reads RoPE in both transformers layouts (5's
`rope_parameters`, 4's top-level `rope_theta` + `rope_scaling`); `gated_activation` checks the
MLP's gate. A family's adapter composes them and adds its own flags, so each difference between
families is stated once, in that family's module. Every problem is a ValueError naming the key.
"""

from __future__ import annotations

from typing import Any

from kvserve.models.config import checkpoint_dtype, layer_windows, yarn_mscale

ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size")


def decoder_fields(d: dict[str, Any], arch: str, *, max_positions: int, eps: float = 1e-6,
                   head_dim: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
    """The fields every family reads the same way. `max_positions` and `eps` are the family's
    defaults for an absent max_position_embeddings / rms_norm_eps, `head_dim` its default when
    the key is absent (Qwen3's 128; else hidden_size / num_attention_heads), `kv_heads` a fixed
    KV head count (MLA's one latent per token)."""
    missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing} for {arch}")
    hidden = pos_int(d, "hidden_size")
    layers = pos_int(d, "num_hidden_layers")
    heads = pos_int(d, "num_attention_heads")
    if kv_heads is None:
        kv_heads = pos_int(d, "num_key_value_heads") if d.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if d.get("head_dim") is not None:
        dim = pos_int(d, "head_dim")
    elif head_dim is not None and "head_dim" not in d:
        dim = head_dim
    else:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not a multiple of "
                             f"num_attention_heads ({heads}) and no head_dim is given")
        dim = hidden // heads
    if dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {dim}")
    if d.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"pretraining_tp={d['pretraining_tp']} is not supported (only 1)")
    windows = layer_windows(d, layers)
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=dim,
        intermediate_size=pos_int(d, "intermediate_size"), vocab_size=pos_int(d, "vocab_size"),
        rms_norm_eps=float(d.get("rms_norm_eps") or eps),
        max_position_embeddings=int(d.get("max_position_embeddings") or max_positions),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_windows=windows if any(w is not None for w in windows) else (),
        torch_dtype=checkpoint_dtype(d), eos_token_id=d.get("eos_token_id"))


def llama_fields(d: dict[str, Any], arch: str, *, max_positions: int, eps: float = 1e-6,
                 mlp_bias: bool = True) -> dict[str, Any]:
    """The fields of a Llama-shaped decoder (what Granite, SmolLM3, Qwen3-MoE and Mixtral
    start from): `decoder_fields`, the SiLU gate, RoPE, biases on q, k, v and o from
    `attention_bias` and, where the family has the key, on the MLP from `mlp_bias`."""
    f = decoder_fields(d, arch, max_positions=max_positions, eps=eps)
    f["hidden_act"] = gated_activation(d, arch)
    f.update(rope_fields(d, f["max_position_embeddings"]))
    bias = bool(d.get("attention_bias", False))
    f.update(attention_bias=bias, o_proj_bias=bias,
             mlp_bias=mlp_bias and bool(d.get("mlp_bias", False)))
    return f


def gated_activation(d: dict[str, Any], arch: str, key: str = "hidden_act",
                     default: str = "silu") -> str:
    """The gated MLP's activation, which must be the family's `default` (SiLU; Gemma's
    GELU-tanh, read from `hidden_activation` first)."""
    act = d.get(key, d.get("hidden_act")) if key != "hidden_act" else d.get(key, default)
    if act is None:
        act = default
    if act != default:
        raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only {default})")
    return act


def rope_fields(d: dict[str, Any], max_pos: int, default_theta: float = 10000.0,
                supported: tuple[str, ...] = ROPE_TYPES,
                partial: bool = False) -> dict[str, Any]:
    """rope_theta and rope_scaling (None for plain RoPE), resolved the way transformers resolves
    them; with `partial`, also rotary_dim from a partial_rotary_factor (else a factor other than
    1 is refused)."""
    params = _rope_params(d)
    theta = params.get("rope_theta", d.get("rope_theta"))
    theta = default_theta if theta is None else float(theta)
    if theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(supported)}")
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": _scaling(params, d, max_pos,
                                                                         rope_type)}
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        if not partial:
            raise ValueError(f"partial_rotary_factor={factor} is not supported")
        out["partial_rotary_factor"] = _positive(factor, "partial_rotary_factor")
    return out


def _rope_params(d: dict[str, Any]) -> dict[str, Any]:
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    return params


def _scaling(params: dict[str, Any], d: dict[str, Any], max_pos: int,
             rope_type: str) -> dict[str, Any] | None:
    if rope_type == "default":
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": _rope_float(params, "factor")}
    if rope_type == "llama3":
        scaling["low_freq_factor"] = _rope_float(params, "low_freq_factor")
        scaling["high_freq_factor"] = _rope_float(params, "high_freq_factor")
        if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
            raise ValueError("llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
                             f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
        original = params.get("original_max_position_embeddings",
                              d.get("original_max_position_embeddings", max_pos))
        scaling["original_max_position_embeddings"] = int(original)
    if rope_type == "yarn":
        scaling.update(_yarn(params, d, max_pos, scaling["factor"]))
    return scaling


def _yarn(params: dict[str, Any], d: dict[str, Any], max_pos: int,
          factor: float) -> dict[str, Any]:
    """YaRN's parameters resolved as transformers' `_compute_yarn_parameters` resolves them:
    beta_fast/beta_slow default 32/1, the correction range truncated unless `truncate` is
    false, and the cos/sin `attention_factor`, when not given, mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) if both are set, else mscale(factor)."""
    original = int(params.get("original_max_position_embeddings",
                              d.get("original_max_position_embeddings", max_pos)))
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    return {"original_max_position_embeddings": original,
            "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1),
            "mscale_all_dim": float(mscale_all or 0),
            "attention_factor": float(attention),
            "truncate": bool(params.get("truncate", True))}


def _rope_float(params: dict[str, Any], key: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"rope scaling of type {params.get('rope_type', params.get('type'))!r} "
                         f"needs a positive {key!r}, got {value!r}")
    return float(value)


def pos_int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def pos_float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    return default if value is None else _positive(value, key)


def opt_pos_float(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else pos_float(d, key, 1.0)


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)
