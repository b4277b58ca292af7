"""From llama.cpp's names to Hugging Face's: a GGUF's metadata as a config.json dict, and its
tensor names as the checkpoint names llama.cpp's converter could have read them from (with
the transforms it applied undone), so that a GGUF file loads through the same `ModelConfig`
and weight targets as a safetensors checkpoint.

Tensor names: no table of kvserve's own. `hf_names` reads llama.cpp's (gguf-py's
`TensorNameMap`, the converter's Hugging Face -> GGUF table) backwards, giving every
checkpoint name a converter maps to that GGUF name; the loader takes the one the
architecture's registry weight map has. A stacked experts tensor (`ffn_*_exps`, [experts,
rows, cols]) is one tensor per expert under `...experts.{e}...`.

What llama.cpp's converter does to a checkpoint, and so what is undone here:
* Llama (Mistral and Mixtral, which it writes as "llama", and Granite): the rows of q and k
  are permuted from Hugging Face's rotate-half RoPE layout to interleaved pairs
  (`unpermute_rows`).
* Gemma 3 and Gemma 2: every `*norm.weight` is written as 1 + w (their norms scale by 1 + w);
  kvserve stores norms that way too, so they are taken as they are (`NORMS_HOLD_ONE_PLUS_W`).
* A tied LM head is written once, as `token_embd.weight` (no `output.weight`).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from kvserve.models import registry

# Architectures whose q/k rows llama.cpp permutes (its LlamaModel.undo_permute).
_PERMUTED = ("llama", "granite")
NORMS_HOLD_ONE_PLUS_W = ("gemma3", "gemma2")
# GGUF architecture -> config.json model_type (the architecture class is the registry's; a
# "llama" file with experts is Mixtral)
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "phi3": "phi3", "olmo2": "olmo2", "granite": "granite",
               "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "deepseek2": "deepseek_v2"}
# llama.cpp hard-codes Gemma 3's layout: five sliding layers per full one, local RoPE base 10k.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0


def check_architecture(metadata: dict[str, Any]) -> str:
    arch = str(metadata.get("general.architecture") or "")
    if not arch:
        raise ValueError("GGUF file has no general.architecture metadata")
    if arch not in _MODEL_TYPE:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(_MODEL_TYPE)}, and Mistral and Mixtral as llama)")
    return arch


def checkpoint_dtype(tensor_types: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    """The sidecar's torch_dtype, what dtype "auto" loads into (`tensor_types`: GGUF name ->
    (type, shape)): "bfloat16" where every tensor of two or more dimensions is BF16, as a
    bf16 safetensors checkpoint says, so that on a CPU with bf16 instructions the weights stay
    at the file's bytes (float32 held a BF16 file's weights at twice them); "float32"
    otherwise: the block formats' kernels take float32 activations, and an F16 file in bf16
    would lose three bits of every weight."""
    matrices = [t for t, shape in tensor_types.values() if len(shape) >= 2]
    return "bfloat16" if matrices and all(t == "BF16" for t in matrices) else "float32"


def hf_config(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
              rope_freqs: np.ndarray | None = None, torch_dtype: str = "float32") -> dict:
    """The config.json a Hugging Face checkpoint of this model would carry (`rope_freqs`:
    the file's tensor of that name, where it has one; `torch_dtype`: `checkpoint_dtype`)."""
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
    experts = metadata.get(f"{arch}.expert_count")
    if arch == "llama" and experts:
        model_type = "mixtral"
    if arch == "deepseek2" and metadata.get("deepseek2.expert_gating_func") == _SIGMOID:
        model_type = "deepseek_v3"
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [registry.by_model_type(model_type).name],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", key(
            "expert_feed_forward_length", required=False))),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        # what the loader dequantizes into with dtype "auto" (and what the planner sizes)
        "torch_dtype": torch_dtype,
        "vocab_size": int(embed[0]),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    value_length = key("attention.value_length", config["head_dim"], required=False)
    if int(value_length) != config["head_dim"] and arch != "deepseek2":
        raise ValueError(f"GGUF key length {config['head_dim']} != value length {value_length}:"
                         " not supported")
    rope_dims = key("rope.dimension_count", config["head_dim"], required=False)
    if int(rope_dims) != config["head_dim"] and arch not in ("phi3", "deepseek2"):
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {config['head_dim']} "
                         "dimensions) are not supported")
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0,
                                                            required=False))}
    if int(rope_dims) != config["head_dim"] and arch == "phi3":  # partial_rotary_factor
        rope["partial_rotary_factor"] = int(rope_dims) / config["head_dim"]
    rope.update(_rope_scaling(arch, metadata, tensor_shapes, rope_freqs))
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3(metadata, config, rope))
    else:
        config["rope_parameters"] = rope
        config["hidden_act"] = "silu"
    if arch in ("llama", "granite", "olmo2"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch in ("llama", "granite"):
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    config.update(_family_keys(arch, model_type, metadata, config, tensor_shapes))
    return config


def _family_keys(arch: str, model_type: str, metadata: dict[str, Any], config: dict[str, Any],
                 tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The config keys of one family that llama.cpp writes under its own names."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    out: dict[str, Any] = {}
    if arch == "phi3":
        if "rope_factors_long.weight" in tensor_shapes:
            raise ValueError("GGUF Phi-3 long-context RoPE factors (rope_factors_long/short) "
                             "are not supported; load the Hugging Face checkpoint instead")
        out["sliding_window"] = key("attention.sliding_window")
    elif arch == "gemma2":
        out.update(_gemma2(metadata, config))
    elif arch == "deepseek2":
        out.update(_deepseek2(metadata, config, tensor_shapes))
    elif arch == "granite":
        out.update(attention_multiplier=float(key("attention.scale", 1.0)),
                   embedding_multiplier=float(key("embedding_scale", 1.0)),
                   residual_multiplier=float(key("residual_scale", 1.0)),
                   logits_scaling=float(key("logit_scale", 1.0)))
    elif model_type in ("qwen3_moe", "mixtral"):
        count = int(key("expert_count"))
        out["num_experts_per_tok"] = int(key("expert_used_count"))
        if model_type == "mixtral":
            out["num_local_experts"] = count
        else:  # llama.cpp runs Qwen3-MoE with the top-k weights normalised
            layers = config["num_hidden_layers"]
            out.update(num_experts=count, norm_topk_prob=True,
                       moe_intermediate_size=int(key("expert_feed_forward_length")),
                       mlp_only_layers=[i for i in range(layers)
                                        if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes])
    return out


def _rope_scaling(arch: str, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                  rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_shapes:
        if rope_freqs is None:
            raise ValueError("GGUF rope_freqs given without its values")
        return _llama3_from_factors(rope_freqs, metadata, arch)
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear",
                "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn" and arch == "deepseek2":
        # DeepSeek's YaRN; llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier (and
        # the checkpoints have mscale == mscale_all_dim)
        mscale = float(metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        return {"rope_type": "yarn", "factor": float(metadata[f"{arch}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(
                    metadata[f"{arch}.rope.scaling.original_context_length"]),
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale,
                "mscale_all_dim": mscale}
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (none, linear)")


def _llama3_from_factors(factors: np.ndarray, metadata: dict[str, Any],
                         arch: str) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling as transformers states it, from the per-frequency divisors
    llama.cpp's converter writes instead (`rope_freqs`: 1 for short wavelengths, `factor` for
    long ones, a smooth ramp between). Every Llama 3.1 / 3.2 GGUF has them.

    Why recover the parameters rather than keep the divisors: the sidecar stays a config.json
    transformers reads, and the one RoPE code path (`rotary._inv_freq`) serves both. On the
    ramp 1 / f is linear in 1 / wavelength, which fixes original_max_position_embeddings /
    (high - low) and low / (high - low); the original context (the file's, else Llama 3's
    8,192) picks one of the equivalent triples. With fewer than two frequencies on the ramp
    (a small head_dim) the ramp's edges are put between the neighbouring frequencies. The
    divisors the triple gives are checked against the file's, so a file whose factors are
    not of this form is refused, not approximated."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    dim = 2 * f.shape[0]
    base = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    if np.allclose(f, 1.0):
        return {}
    factor = float(f.max())
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2) / dim)  # increasing
    old_len = float(metadata.get(f"{arch}.rope.scaling.original_context_length", 8192))
    ramp = np.flatnonzero((f > 1 + 1e-6) & (f < factor - 1e-6))
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # 1 at short wavelengths, 0 at long ones
    ones, full = np.flatnonzero(f <= 1 + 1e-6), np.flatnonzero(f >= factor - 1e-6)
    short_edge = wavelen[ones[-1]] if ones.size else wavelen[0] / 2
    long_edge = wavelen[full[0]] if full.size else wavelen[-1] * 2
    if ramp.size >= 2:  # s = old_len / ((high - low) wavelength) - low / (high - low)
        slope = (s[ramp[-1]] - s[ramp[0]]) / (1 / wavelen[ramp[-1]] - 1 / wavelen[ramp[0]])
        width = old_len / slope
        low = (slope / wavelen[ramp[0]] - s[ramp[0]]) * width
        high = low + width
    elif ramp.size == 1:  # in 1 / wavelength u: s_r = (u_r - u_low) / (u_high - u_low)
        u_r, u_short, u_long = 1 / wavelen[ramp[0]], 1 / short_edge, 1 / long_edge
        grow = (u_r - u_long) * (1 / s[ramp[0]] - 1)  # u_high - u_r per unit t below
        t = min(0.5, 0.5 * (u_short - u_r) / grow) if grow > 0 else 0.5
        u_low = u_r - t * (u_r - u_long)  # the long edge between the point and the next
        low, high = old_len * u_low, old_len * (u_low + (u_r - u_low) / s[ramp[0]])
    else:  # a step: both edges between the last 1 and the first full factor
        high = old_len / (short_edge ** (2 / 3) * long_edge ** (1 / 3))
        low = old_len / (short_edge ** (1 / 3) * long_edge ** (2 / 3))
    out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(float(low), 6),
           "high_freq_factor": round(float(high), 6),
           "original_max_position_embeddings": int(old_len)}
    if not 0 < low < high or not np.allclose(_llama3_divisors(wavelen, out), f, rtol=1e-4):
        raise ValueError("GGUF rope_freqs are not Llama 3-style RoPE scaling (1, a smooth "
                         f"ramp, then one factor): {np.round(f, 4).tolist()}")
    return out


def _llama3_divisors(wavelen: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """What the llama3 rule divides each frequency by (transformers' formula)."""
    old, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], \
        p["high_freq_factor"]
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / p["factor"] + smooth)


# llama.cpp's expert_gating_func values
_SOFTMAX, _SIGMOID = 1, 2


def _deepseek2(metadata: dict[str, Any], config: dict[str, Any],
               tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """DeepSeek-V2/V3's MLA and MoE keys from llama.cpp's: key_length is the nope + RoPE
    head, value_length the value head, rope.dimension_count the RoPE part; the gating
    function tells V3 (sigmoid) from V2 (softmax)."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"deepseek2.{name}", default)

    if "blk.0.attn_kv_b.weight" not in tensor_shapes and \
            "blk.0.attn_k_b.weight" in tensor_shapes:
        raise ValueError("this DeepSeek GGUF stores kv_b split as attn_k_b / attn_v_b (newer "
                         "llama.cpp converters) without attn_kv_b; not supported yet: load "
                         "the Hugging Face checkpoint, or a GGUF with attn_kv_b")
    rope = int(key("rope.dimension_count"))
    q_lora = int(key("attention.q_lora_rank", 0) or 0)
    groups = int(key("expert_group_count", 1) or 1)
    v3 = key("expert_gating_func") == _SIGMOID
    out: dict[str, Any] = {
        "kv_lora_rank": int(key("attention.kv_lora_rank")),
        "q_lora_rank": q_lora or None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key("attention.key_length")) - rope,
        "v_head_dim": int(key("attention.value_length")),
        "head_dim": rope,
        "n_routed_experts": int(key("expert_count", 0) or 0),
        "num_experts_per_tok": int(key("expert_used_count", 0) or 0),
        "n_shared_experts": int(key("expert_shared_count", 0) or 0),
        "moe_intermediate_size": int(key("expert_feed_forward_length", 0) or 0),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0) or 0),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0) or 1.0),
        "n_group": groups, "topk_group": int(key("expert_group_used_count", 1) or 1),
    }
    if v3:
        out.update(scoring_func="sigmoid", topk_method="noaux_tc",
                   norm_topk_prob=bool(key("expert_weights_norm", True)))
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


# Gemma 2 27B's layer count: llama.cpp scales its queries by 1/sqrt(hidden / heads), the other
# sizes by 1/sqrt(head_dim) (the GGUF states no query_pre_attn_scalar)
_GEMMA2_27B_LAYERS = 46


def _gemma2(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 as llama.cpp runs a GGUF of it: soft-capped attention and logits, every other
    layer sliding from the first, GELU-tanh, the query scale by model size."""
    layers = config["num_hidden_layers"]
    window = metadata.get("gemma2.attention.sliding_window")
    scalar = config["hidden_size"] // config["num_attention_heads"] \
        if layers == _GEMMA2_27B_LAYERS else config["head_dim"]
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar,
            "attn_logit_softcapping": metadata.get("gemma2.attn_logit_softcapping"),
            "final_logit_softcapping": metadata.get("gemma2.final_logit_softcapping"),
            "sliding_window": None if window is None else int(window),
            "layer_types": ["sliding_attention" if i % 2 == 0 and window is not None
                            else "full_attention" for i in range(layers)],
            "tie_word_embeddings": config["tie_word_embeddings"]}


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


_LAYER = re.compile(r"^blk\.(\d+)\.(.*)$")
_SUFFIX = re.compile(r"^(.*?)((?:\.weight|\.bias)?)$")


@functools.lru_cache(maxsize=16)
def _inverse(arch: str) -> dict[str, tuple[str, ...]]:
    """llama.cpp's converter table for `arch`, backwards: GGUF name (block 0's as "blk.{i}.")
    -> the Hugging Face-style checkpoint names (model.*, lm_head) it maps there."""
    import gguf

    by_name = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.TensorNameMap(by_name[arch], 1)
    out: dict[str, list[str]] = {}
    for hf, (_, name) in table.mapping.items():
        if not hf.startswith(("model.", "lm_head")):
            continue
        m = _LAYER.match(name)
        if m is not None:
            name, hf = "blk.{i}." + m.group(2), hf.replace(".0.", ".{i}.", 1)
        out.setdefault(name, []).append(hf)
    return {k: tuple(v) for k, v in out.items()}


def hf_names(arch: str, gguf_name: str, expert: int | None = None) -> tuple[str, ...]:
    """The checkpoint names a GGUF tensor may have been converted from (llama.cpp's own table,
    read backwards), with ".weight" / ".bias"; expert `expert` of a stacked experts tensor
    under its per-expert names. () where the architecture has no such tensor."""
    base, suffix = _SUFFIX.match(gguf_name).groups()
    m = _LAYER.match(base)
    key = base if m is None else "blk.{i}." + m.group(2)
    names = _inverse(arch).get(key, ())
    if m is not None:
        names = tuple(n.format(i=m.group(1)) for n in names)
    if expert is not None:
        names = tuple(n.replace(".experts.", f".experts.{expert}.", 1) for n in names
                      if ".experts." in n)
    # (DeepSeek-V3's router bias: the converter renames e_score_correction_bias to
    # e_score_correction.bias before it looks the name up)
    return tuple((n + suffix).replace(".e_score_correction.bias", ".e_score_correction_bias")
                 for n in names)


def derived(arch: str, gguf_name: str, names: Any) -> bool:
    """Whether a tensor restates what the file also holds, and is skipped: rope_freqs (in the
    config as RoPE scaling), DeepSeek's attn_k_b / attn_v_b, which llama.cpp's converter
    writes beside attn_kv_b (its split, for the absorbed attention)."""
    if gguf_name == "rope_freqs.weight":  # the RoPE scaling, read into the config
        return True
    if arch != "deepseek2" or not (".attn_k_b." in gguf_name or ".attn_v_b." in gguf_name):
        return False
    block = gguf_name.split(".")[1]
    return f"blk.{block}.attn_kv_b.weight" in names


def needs_unpermute(arch: str, gguf_name: str) -> bool:
    return arch in _PERMUTED and (".attn_q." in gguf_name or ".attn_k." in gguf_name)


def unpermute_rows(w: np.ndarray, heads: int, out: np.ndarray | None = None) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (pair j, member m) at 2j + m go back to
    m * (head_dim / 2) + j, Hugging Face's rotate-half layout. `heads` is the query head count
    for q and the KV head count for k; a bias (1-D) is permuted like the rows. Written into
    `out` (contiguous, w's shape) where given."""
    rows = w.shape[0]
    half = rows // heads // 2
    moved = w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
    if out is None:
        return moved.reshape(w.shape)
    out.reshape(heads, 2, half, *w.shape[1:])[...] = moved
    return out
