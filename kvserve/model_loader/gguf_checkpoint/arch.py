"""From llama.cpp's names to Hugging Face's: a GGUF's metadata as a config.json dict, and its
tensor names as checkpoint tensor names (with the transforms llama.cpp's converter applied
undone), so that a GGUF file loads through the same `ModelConfig` and weight targets as a
safetensors checkpoint.

What llama.cpp's converter does to a checkpoint, and so what is undone here:
* Llama (and Mistral, which it writes as "llama"): the rows of q and k are permuted from
  Hugging Face's rotate-half RoPE layout to interleaved pairs (`unpermute_rows`).
* Gemma 3: every `*norm.weight` is written as 1 + w (its norms scale by 1 + w); kvserve stores
  norms that way too, so they are taken as they are (`NORMS_HOLD_ONE_PLUS_W`).
* A tied LM head is written once, as `token_embd.weight` (no `output.weight`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from kvserve.models import registry

# Architectures whose q/k rows llama.cpp permutes (its LlamaModel.undo_permute).
_PERMUTED = ("llama",)
NORMS_HOLD_ONE_PLUS_W = ("gemma3",)
# GGUF architecture -> config.json model_type (the architecture class is the registry's)
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# llama.cpp hard-codes Gemma 3's layout: five sliding layers per full one, local RoPE base 10k.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0


def check_architecture(metadata: dict[str, Any]) -> str:
    arch = str(metadata.get("general.architecture") or "")
    if not arch:
        raise ValueError("GGUF file has no general.architecture metadata")
    if arch not in _MODEL_TYPE:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(_MODEL_TYPE)})")
    return arch


def hf_config(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict:
    """The config.json a Hugging Face checkpoint of this model would carry."""
    arch = check_architecture(metadata)

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ValueError(f"GGUF file lacks metadata {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError("GGUF files with a per-layer KV head count are not supported")
    hidden = int(key("embedding_length"))
    embed = tensor_shapes.get("token_embd.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    model_type = _MODEL_TYPE[arch]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [registry.by_model_type(model_type).name],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        # what the loader dequantizes into with dtype "auto" (and what the planner sizes)
        "torch_dtype": "float32",
        "vocab_size": int(embed[0]),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    value_length = key("attention.value_length", config["head_dim"], required=False)
    if int(value_length) != config["head_dim"]:
        raise ValueError(f"GGUF key length {config['head_dim']} != value length {value_length}:"
                         " not supported")
    rope_dims = key("rope.dimension_count", config["head_dim"], required=False)
    if int(rope_dims) != config["head_dim"]:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {config['head_dim']} "
                         "dimensions) are not supported")
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0,
                                                            required=False))}
    rope.update(_rope_scaling(arch, metadata, tensor_shapes))
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3(metadata, config, rope))
    else:
        config["rope_parameters"] = rope
        config["hidden_act"] = "silu"
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    return config


def _rope_scaling(arch: str, metadata: dict[str, Any],
                  tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError("GGUF rope_freqs (Llama 3.1-style per-frequency RoPE factors) are not "
                         "supported; load the Hugging Face checkpoint instead")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear",
                "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (none, linear)")


def _gemma3(metadata: dict[str, Any], config: dict[str, Any],
            rope: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = metadata.get("gemma3.attention.sliding_window")
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["head_dim"],
        "rope_parameters": {"full_attention": rope,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": _GEMMA3_LOCAL_THETA}},
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }
    if window is None:
        out["sliding_window"] = None
        out["layer_types"] = ["full_attention"] * layers
    else:
        out["sliding_window"] = int(window)
        out["layer_types"] = ["sliding_attention" if (i + 1) % _GEMMA3_PATTERN
                              else "full_attention" for i in range(layers)]
    return out


# GGUF tensor name -> checkpoint tensor name; "{i}" is the layer.
_COMMON = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
}
_FFN_NORM = {"blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}
_GEMMA3_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.*)$")


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The checkpoint name of a GGUF tensor, or None when this architecture has no such tensor
    (the loader then refuses it by name)."""
    table = {**_COMMON, **(_GEMMA3_NORMS if arch == "gemma3" else _FFN_NORM)}
    m = _LAYER.match(gguf_name)
    if m is None:
        return table.get(gguf_name)
    pattern = table.get("blk.{i}." + m.group(2))
    return None if pattern is None else pattern.format(i=m.group(1))


def needs_unpermute(arch: str, gguf_name: str) -> bool:
    return arch in _PERMUTED and (".attn_q." in gguf_name or ".attn_k." in gguf_name)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (pair j, member m) at 2j + m go back to
    m * (head_dim / 2) + j, Hugging Face's rotate-half layout. `heads` is the query head count
    for q and the KV head count for k; a bias (1-D) is permuted like the rows."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
