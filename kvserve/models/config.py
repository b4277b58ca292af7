"""The model's shape and hyper-parameters: `ModelConfig`, what the model code reads.

One `ModelConfig` describes every supported architecture; the differences between them are a
few flags (`attention_bias`, `qk_norm`, the norm placement `pre_norms` / `output_norms`,
Gemma 3's `embed_scale`, activation, attention scale, logit soft-capping and local RoPE base,
Phi-3's partial `rotary_dim`) that the single decoder in `kvserve.models.decoder` reads. Which
flags an architecture sets is its family's business: `kvserve.models.registry` turns a Hugging
Face `config.json` into a `ModelConfig` (`config_from_dict`, `config_from_dir`), one module per
family under `kvserve/models/`. This module stays below the model code and the registry, so both
can import it.

`read_json_object`, `checkpoint_dtype` and `layer_windows` are the checkpoint-file readers the
registry, the planner and the tokenizer share, so that a config.json means the same to every
component.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.utils.dtypes import DTYPES, canonical_dtype
from kvserve.models.deepseek_config import MLAConfig, MoEConfig


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
    qk_norm: bool = False  # RMSNorm of q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    # True: one norm per head over head_dim (Qwen3, Gemma 3); False: one over the whole q (and
    # one over the whole k) projection, all heads together (OLMo 2)
    qk_norm_per_head: bool = True
    # One entry per layer: None = full attention, an int W = the layer attends to the last W
    # positions (its own included), as transformers' sliding-window mask does. () = all full.
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None  # "float32" | "bfloat16" | "float16" | None (not given)
    eos_token_id: int | list[int] | None = None
    mla: MLAConfig | None = None  # DeepSeek-V2/V3: head_dim is then the RoPE dim
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    # Where the layer's RMSNorms sit: `pre_norms` before attention and before the MLP (every
    # family but OLMo 2), `output_norms` on the attention's and the MLP's outputs before their
    # residual adds (Gemma 3 has both, OLMo 2 only these).
    pre_norms: bool = True
    output_norms: bool = False
    embed_scale: float | None = None  # Gemma: embeddings are multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Gemma 2: attention scores = cap * tanh(scores / cap), before the mask and the softmax
    attn_logit_softcapping: float | None = None
    # Granite: the softmax scale itself (attention_multiplier) and a divisor of the logits
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # RoPE base of the sliding layers when it differs from the full layers' (Gemma 3: 10,000
    # locally, 1,000,000 globally; unscaled: `gemma3` refuses scaling there); None = the same
    # as rope_theta / rope_scaling.
    sliding_rope_theta: float | None = None
    # Which layers rotate q and k (SmolLM3 leaves every fourth without RoPE); () = all of them
    rope_layers: tuple[bool, ...] = ()
    # Partial RoPE (Phi-3's partial_rotary_factor < 1): only the first rotary_dim dimensions of
    # each head rotate; None = all of head_dim.
    rotary_dim: int | None = None
    # What only one family's own code reads (its weight map, its layers), as that family's
    # own frozen dataclass (e.g. `granite.GraniteSettings`), made by its config adapter:
    # not fields here, where every architecture and the engine would carry them (issue 65).
    family: Any = None

    @property
    def one_rope(self) -> bool:
        """Whether every layer rotates with the same table (no local RoPE base, no NoPE
        layers): what the one-call decode steps need."""
        return self.sliding_rope_theta is None and all(self.rope_layers)

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
        mscale(factor, mscale_all_dim)^2, as transformers applies them; Granite's
        attention_multiplier where it has one."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
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


# transformers' default `sliding_window` when a config.json leaves the key out (an explicit null
# means full attention).
_DEFAULT_WINDOW = {"mistral": 4096, "gemma3_text": 4096, "gemma3": 4096, "gemma2": 4096}


def layer_windows(d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer: None for full attention, else its sliding window in tokens, by the rules
    transformers applies to each family (the engine and the planner both read windows here):

    * Qwen2/Qwen3 and SmolLM3: `sliding_window` counts only with `use_sliding_window`; then
      `layer_types` if given, else layers from `max_window_layers` on slide;
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
    if (model_type.startswith("qwen") or model_type == "smollm3") \
            and not d.get("use_sliding_window", False):
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction, 0.1 * mscale * ln(factor) + 1 (1 when the
    context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
