"""The model's shape and hyper-parameters, read from a Hugging Face `config.json`.

One `ModelConfig` describes all supported architectures; the differences between them are a few
flags (`attention_bias`, `qk_norm`, and Gemma 3's `gemma_norms`, `embed_scale`, activation,
attention scale, logit soft-capping and local RoPE base) that the single decoder in
`kvserve.model.decoder` reads.
Both the transformers 5 layout (`rope_parameters`, `dtype`) and the older one (`rope_theta`,
`rope_scaling`, `torch_dtype` at the top level) are accepted.

`read_json_object` and `checkpoint_dtype` are the checkpoint-file readers the planner and the
tokenizer use too, so that a config.json means the same to every component.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.dtypes import DTYPES, canonical_dtype
from kvserve.model.deepseek_config import (DEEPSEEK_ARCHITECTURES, MLAConfig, MoEConfig,
                                           parse_mla, parse_moe)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
    "Gemma3ForCausalLM",
)
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# transformers' per-class defaults for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "MistralForCausalLM": 131072,
    "DeepseekV2ForCausalLM": 2048,
    "DeepseekV3ForCausalLM": 4096,
    "Gemma3ForCausalLM": 131072,
}
# The MLP's gate activation, by transformers' name (`hidden_act`, Gemma's `hidden_activation`).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# YaRN is read for the DeepSeek configs, which use it (with DeepSeek's mscale on the softmax).
DEEPSEEK_ROPE_TYPES = SUPPORTED_ROPE_TYPES + ("yarn",)
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size")


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else {"rope_type": "linear" | "llama3", ...its parameters}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama/Qwen3 also on o_proj)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    # One entry per layer: None = full attention, an int W = the layer attends to the last W
    # positions (its own included), as transformers' sliding-window mask does. () = all full.
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None  # "float32" | "bfloat16" | "float16" | None (not given)
    eos_token_id: int | list[int] | None = None
    mla: MLAConfig | None = None  # DeepSeek-V2/V3: head_dim is then the RoPE dim
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    # Gemma 3: norms scale by (1 + weight) (the loader stores 1 + weight), the attention and MLP
    # outputs are normed before their residual adds, and q/k have per-head norms.
    gemma_norms: bool = False
    embed_scale: float | None = None  # Gemma: embeddings are multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # RoPE of the sliding layers when it differs from the full layers' (Gemma 3: base 10,000
    # locally, 1,000,000 globally); None = the same as rope_theta / rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(head_dim), Gemma's query_pre_attn_scalar ** -0.5, or for
        MLA 1/sqrt(qk_nope + qk_rope) times DeepSeek's YaRN correction
        mscale(factor, mscale_all_dim)^2, as transformers applies them."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar ** -0.5
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        r = self.rope_scaling
        if r is not None and r.get("mscale_all_dim"):
            m = yarn_mscale(r["factor"], r["mscale_all_dim"])
            scale *= m * m
        return scale

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None = full attention), one entry per layer."""
        return self.layer_windows or (None,) * self.num_hidden_layers

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # -- parsing ----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read `<path>/config.json`; every problem is a `ValueError` naming the path."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{str(config_file)!r} not found: a model directory must hold a "
                             "Hugging Face config.json")
        data = read_json_object(config_file)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{str(config_file)!r}: {e}") from e

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(d)
        missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required key(s) {missing} for {arch}")
        hidden = _pos_int(d, "hidden_size")
        layers = _pos_int(d, "num_hidden_layers")
        heads = _pos_int(d, "num_attention_heads")
        kv_heads = _pos_int(d, "num_key_value_heads") if d.get("num_key_value_heads") else heads
        if arch in DEEPSEEK_ARCHITECTURES:
            kv_heads = 1  # MLA: one latent per token, shared by every head
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        if d.get("head_dim") is not None:
            head_dim = _pos_int(d, "head_dim")
        elif arch == "Qwen3ForCausalLM" and "head_dim" not in d:
            head_dim = 128  # transformers' Qwen3Config default when the key is absent
        else:
            if hidden % heads:
                raise ValueError(f"hidden_size ({hidden}) is not a multiple of "
                                 f"num_attention_heads ({heads}) and no head_dim is given")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        gemma = arch == "Gemma3ForCausalLM"
        act = d.get("hidden_activation", d.get("hidden_act")) if gemma else \
            d.get("hidden_act", "silu")
        if act is None:
            act = "gelu_pytorch_tanh"  # Gemma3TextConfig's default
        if act not in SUPPORTED_ACTIVATIONS or (act != "silu") != gemma:
            raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only "
                             f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
        if gemma:
            _refuse_gemma_options(d)
        if d.get("pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"pretraining_tp={d['pretraining_tp']} is not supported (only 1)")

        max_pos = d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
        deepseek = arch in DEEPSEEK_ARCHITECTURES
        if gemma:
            (rope_theta, rope_scaling), (local_theta, local_scaling) = _gemma3_rope(d,
                                                                                   int(max_pos))
        else:
            supported = DEEPSEEK_ROPE_TYPES if deepseek else SUPPORTED_ROPE_TYPES
            rope_theta, rope_scaling = _rope(d, int(max_pos), supported=supported)
            local_theta, local_scaling = None, None
        mla = parse_mla(d) if deepseek else None
        if deepseek and mla is None:
            raise ValueError(f"{arch} needs a positive kv_lora_rank")
        if deepseek and (d.get("attention_bias") or d.get("mlp_bias")):
            raise ValueError(f"{arch} with attention_bias or mlp_bias is not supported")
        if mla is not None:
            # transformers' DeepseekV2/V3Config: head_dim is the RoPE dim (it sizes the rotary
            # embedding); attention itself uses the MLA dimensions.
            head_dim = mla.qk_rope_head_dim

        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias = o_bias = False
        else:  # Llama, Qwen3, Gemma 3: one flag for q, k, v and o
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False
        dtype = checkpoint_dtype(d)
        windows = layer_windows(d, layers)

        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_pos_int(d, "intermediate_size"),
            vocab_size=_pos_int(d, "vocab_size"),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(max_pos),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            layer_windows=windows if any(w is not None for w in windows) else (),
            torch_dtype=dtype,
            eos_token_id=d.get("eos_token_id"),
            mla=mla,
            moe=parse_moe(d, layers) if deepseek else None,
            hidden_act=act,
            gemma_norms=gemma,
            embed_scale=hidden ** 0.5 if gemma else None,
            query_pre_attn_scalar=_pos_float(d, "query_pre_attn_scalar", 256.0) if gemma
            else None,
            final_logit_softcapping=_opt_pos_float(d, "final_logit_softcapping"),
            sliding_rope_theta=local_theta,
            sliding_rope_scaling=local_scaling,
        )


# transformers' default `sliding_window` when a config.json leaves the key out (an explicit null
# means full attention).
_DEFAULT_WINDOW = {"mistral": 4096, "gemma3_text": 4096, "gemma3": 4096, "gemma2": 4096}


def layer_windows(d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer: None for full attention, else its sliding window in tokens, by the rules
    transformers applies to each family (the engine and the planner both read windows here):

    * Qwen2/Qwen3: `sliding_window` counts only with `use_sliding_window`; then `layer_types`
      if given, else layers from `max_window_layers` on slide;
    * an explicit `layer_types` list (Qwen, Gemma 3, gpt-oss): "sliding_attention" layers slide;
    * Gemma 2: even layers slide; Gemma 3 without `layer_types`: every layer but each
      `sliding_window_pattern`-th (default 6);
    * Mistral and anything else with a `sliding_window`: every layer (Mistral's default is
      4,096 when the key is absent, as in transformers).

    A sliding layer type with no window, or a window that is not a positive integer, is a
    ValueError."""
    model_type = str(d.get("model_type") or "")
    if "sliding_window" in d:
        window = d["sliding_window"]
    else:
        window = _DEFAULT_WINDOW.get(model_type)
    if model_type.startswith("qwen") and not d.get("use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(f"layer_types must list {num_layers} layer types, got {types!r}")
        out: list[int | None] = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t in ("sliding_attention", "chunked_attention"):
                w = window or d.get("attention_chunk_size")
                if not w:
                    raise ValueError(f"layer type {t!r} needs a sliding_window (for Qwen, also "
                                     "use_sliding_window: true)")
                out.append(int(w))
            else:
                raise ValueError(f"layer type {t!r} is not supported (full_attention, "
                                 "sliding_attention, chunked_attention)")
        return tuple(out)
    if window is None:
        return (None,) * num_layers
    if model_type.startswith("qwen"):
        first = int(d.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type == "gemma2":
        return tuple(window if (i + 1) % 2 else None for i in range(num_layers))
    pattern = d.get("sliding_window_pattern")
    if pattern is None and model_type.startswith("gemma3"):
        pattern = 6
    if pattern:
        return tuple(window if (i + 1) % int(pattern) else None for i in range(num_layers))
    return (window,) * num_layers


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse a checkpoint's JSON file (config.json, tokenizer_config.json, ...); an unreadable
    file or anything but a JSON object is a ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def checkpoint_dtype(d: dict[str, Any]) -> str | None:
    """The weights' dtype a config.json names (transformers 5's `dtype`, else the older
    `torch_dtype`, either possibly spelled "torch.bfloat16"), as torch's name; None when it
    names none, ValueError when it names one the engine cannot run."""
    raw = d.get("dtype", d.get("torch_dtype"))
    if raw is None:
        return None
    dtype = canonical_dtype(str(raw).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {raw!r} is not supported; use one of {', '.join(DTYPES)}")
    return dtype


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"'architectures' must be a list of names, got {archs!r}")
        arch = archs[0]
    elif d.get("model_type") in ARCH_BY_MODEL_TYPE:
        arch = ARCH_BY_MODEL_TYPE[d["model_type"]]
    else:
        raise ValueError("config has no 'architectures' entry and no known 'model_type' "
                         f"(got {d.get('model_type')!r}); supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _pos_int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _refuse_gemma_options(d: dict[str, Any]) -> None:
    """Gemma 3 options the engine does not run, refused rather than silently computed wrong."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it "
                         "null; transformers' SDPA path ignores it too)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: kvserve serves causal "
                         "decoders")


def _pos_float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _opt_pos_float(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else _pos_float(d, key, 1.0)


def _gemma3_rope(d: dict[str, Any], max_pos: int
                 ) -> tuple[tuple[float, dict[str, Any] | None], tuple[float, None]]:
    """Gemma 3's two RoPEs: (full layers', sliding layers'), from transformers 5's per-layer-type
    `rope_parameters` or the older `rope_theta` / `rope_scaling` (global) +
    `rope_local_base_freq` (local). Defaults as Gemma3TextConfig: 1e6 globally, 1e4 locally."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params
                                     or "sliding_attention" in params):
        full = _rope({"rope_parameters": params.get("full_attention") or {}}, max_pos, 1e6)
        local = _rope({"rope_parameters": params.get("sliding_attention") or {}}, max_pos, 1e4)
    else:
        full = _rope(d, max_pos, 1e6)
        local = (_pos_float(d, "rope_local_base_freq", 1e4), None)
    if local[1] is not None:
        raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
    return full, (local[0], None)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction, 0.1 * mscale * ln(factor) + 1 (1 when the
    context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(d: dict[str, Any], max_pos: int, default_theta: float = 10000.0,
          supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES
          ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`, resolved the way transformers resolves them."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    theta = params.get("rope_theta", d.get("rope_theta"))
    theta = default_theta if theta is None else float(theta)
    if theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(supported)}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return theta, None
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
    return theta, scaling


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
