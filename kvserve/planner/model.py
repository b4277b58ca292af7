"""What the planner needs to know of a model, read from a Hugging Face `config.json` or a preset.

An architecture the engine runs is read through its registry entry (`kvserve.models.registry`,
the loader's reading: per-family defaults such as Qwen3's head_dim, MLA's latent), so a plan
describes the KV pool the engine would allocate. Any other decoder (or a config the engine
refuses, such as an fp8 checkpoint's) is read by its shape keys alone: MHA, GQA and MQA
(num_key_value_heads), MLA (kv_lora_rank + qk_rope_head_dim), sliding-window and hybrid layer
patterns (Mistral's window on every layer, Gemma-2's alternation, Gemma-3's
`sliding_window_pattern`, Qwen's `max_window_layers`, or an explicit `layer_types` list), and
dense or mixture-of-experts MLPs for the parameter count.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.utils.dtypes import short_dtype_name
from kvserve.models.config import ModelConfig, checkpoint_dtype, layer_windows, read_json_object
from kvserve.models.deepseek_config import MLAConfig, parse_mla
from kvserve.model_loader.gguf_checkpoint import is_gguf, open_gguf
from kvserve.models import registry
from kvserve.planner.presets import lookup, preset_names

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # "preset", or the path it was read from
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_params: int
    params_source: str  # "published", "safetensors" or "estimated"
    dtype: str  # the checkpoint's dtype: fp32, fp16 or bf16
    kv_lora_rank: int | None = None  # MLA
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE key, stored beside the latent
    # One entry per layer: None = full attention, an int = a sliding window of that many tokens.
    layer_windows: tuple[int | None, ...] = ()
    quantization: dict[str, Any] = field(default_factory=dict)  # config.json's quantization_config
    mla: MLAConfig | None = None  # every MLA dimension (the decompressed K/V it saves)

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "mla"
        if self.num_kv_heads == self.num_attention_heads:
            return "mha"
        if self.num_kv_heads == 1:
            return "mqa"
        return "gqa"

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.layer_windows or (None,) * self.num_layers

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for w in self.windows if w is not None)

    @property
    def embedding_params(self) -> int:
        """Input embedding plus an untied LM head: the parameters quantized checkpoints keep in
        16 bits."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str, source: str,
                       num_params: int | None = None, params_source: str = "estimated"
                       ) -> "ModelSpec":
        """Every problem is a ValueError that names the key."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: a config must be a JSON object")
        if isinstance(d.get("text_config"), dict):  # multimodal wrappers: plan the LM
            d = {**d, **d["text_config"]}
        engine = _engine_config(d)
        shape = _engine_shape(engine, d) if engine is not None else _shape(d, source)
        mla = shape["mla"]
        explicit = d.get("num_params")
        if num_params is None and explicit:
            num_params, params_source = int(explicit), "published"
        if num_params is None:
            num_params = estimate_params(d)
        windows = shape.pop("layer_windows")
        return cls(name=name, source=source, **shape,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   num_params=int(num_params), params_source=params_source,
                   dtype=_checkpoint_dtype(d), kv_lora_rank=mla.kv_lora_rank if mla else None,
                   qk_rope_head_dim=mla.qk_rope_head_dim if mla else 0,
                   layer_windows=windows if any(w is not None for w in windows) else (),
                   quantization=dict(d.get("quantization_config") or {}))

    @classmethod
    def load(cls, what: str) -> "ModelSpec":
        """A preset name, a config.json, a checkpoint directory (whose safetensors headers
        give the exact parameter count) or a GGUF file (its tensor shapes do)."""
        found = lookup(what)
        if found is not None:
            key, d = found
            return cls.from_hf_config(d, key, "preset")
        path = Path(what)
        if is_gguf(path):  # its metadata as config.json, its tensors' shapes counted
            checkpoint = open_gguf(path)
            counted = sum(math.prod(t.shape) for t in checkpoint.index.tensors.values())
            return cls.from_hf_config(checkpoint.config, path.stem, str(path), counted, "gguf")
        if path.is_dir():
            config_file = path / "config.json"
        elif path.is_file():
            config_file = path
        else:
            raise ValueError(f"{what!r} is neither a preset ({', '.join(preset_names())})"
                             " nor a config.json / checkpoint directory")
        if not config_file.is_file():
            raise ValueError(f"{str(path)!r} holds no config.json")
        d = read_json_object(config_file)
        # Packed int4 tensors (AWQ/GPTQ) hide the parameter count: estimate those from shapes.
        counted = None if d.get("quantization_config") else \
            count_safetensors_params(config_file.parent)
        name = config_file.parent.name or str(config_file)
        if counted:
            return cls.from_hf_config(d, name, str(config_file), counted, "safetensors")
        return cls.from_hf_config(d, name, str(config_file))


def _engine_config(d: dict[str, Any]) -> ModelConfig | None:
    """The engine's reading of a config (its registry entry's adapter), or None for an
    architecture it does not run, a config it refuses, or one with MLA keys its architecture
    does not have (the engine would ignore them): the planner still plans those, as the config
    describes them, by their shape keys (`_shape`)."""
    try:
        engine = registry.config_from_dict(d)
        if (engine.mla is None) != (parse_mla(d) is None):
            return None
    except ValueError:
        return None
    return engine


def _engine_shape(c: ModelConfig, d: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's shape fields as the engine reads them. MLA keeps the config's head counts
    and head_dim (the engine's are the latent's: one KV "head", head_dim = the RoPE dim)."""
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    if c.mla is not None:
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or c.hidden_size // heads)
    return dict(architecture=c.architecture, num_layers=c.num_hidden_layers,
                hidden_size=c.hidden_size, num_attention_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim, vocab_size=c.vocab_size,
                max_position_embeddings=c.max_position_embeddings, layer_windows=c.windows,
                mla=c.mla)


def _shape(d: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec's shape fields of any decoder, from its shape keys (and their aliases)."""
    arch = (d.get("architectures") or [d.get("model_type") or "unknown"])[0]
    layers = _pos_int(d, "num_hidden_layers", source, ("n_layer", "num_layers"))
    hidden = _pos_int(d, "hidden_size", source, ("n_embd", "d_model"))
    heads = _pos_int(d, "num_attention_heads", source, ("n_head",))
    if d.get("multi_query"):
        kv_heads = 1
    else:
        kv_heads = _opt_int(d, "num_key_value_heads", source, ("num_kv_heads",)) or heads
    head_dim = _opt_int(d, "head_dim", source) or hidden // heads
    vocab = _pos_int(d, "vocab_size", source)
    try:  # the engine's reader of the MLA dimensions (one parser, one bytes-per-token)
        mla = parse_mla(d)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    if mla is None and heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    max_pos = _opt_int(d, "max_position_embeddings", source, ("n_positions",)) or 2048
    return dict(architecture=arch, num_layers=layers, hidden_size=hidden,
                num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                vocab_size=vocab, max_position_embeddings=max_pos,
                layer_windows=_layer_windows(d, layers, source), mla=mla)


def _checkpoint_dtype(d: dict[str, Any]) -> str:
    """fp32 / fp16 / bf16, read the way the model loader reads it. A dtype the engine cannot run
    (an fp8 checkpoint's, say) or none at all is planned as bf16, the usual serving dtype."""
    try:
        dtype = checkpoint_dtype(d)
    except ValueError:
        dtype = None
    return short_dtype_name(dtype or "bfloat16") or "bf16"


def _key(d: dict[str, Any], key: str, aliases: tuple[str, ...]) -> Any:
    for k in (key, *aliases):
        if d.get(k) is not None:
            return d[k]
    return None


def _pos_int(d: dict[str, Any], key: str, source: str, aliases: tuple[str, ...] = ()) -> int:
    value = _key(d, key, aliases)
    if value is None:
        raise ValueError(f"{source}: config has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _opt_int(d: dict[str, Any], key: str, source: str, aliases: tuple[str, ...] = ()) -> int | None:
    value = _key(d, key, aliases)
    if value is None:
        return None
    return _pos_int({key: value}, key, source)


def _layer_windows(d: dict[str, Any], layers: int, source: str) -> tuple[int | None, ...]:
    """Per layer: None for full attention, else the sliding window in tokens (the engine's
    rules, `kvserve.models.config.layer_windows`), errors prefixed with the source."""
    try:
        return layer_windows(d, layers)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def estimate_params(d: dict[str, Any]) -> int:
    """Parameters of a decoder from its config: embeddings, attention (standard or MLA), and a
    dense, mixture-of-experts (DeepSeek, Qwen-MoE, Mixtral) or mixed MLP stack; norms and q/k/v
    biases included, q/k norms and an o_proj bias left out (well under 0.1%)."""
    if isinstance(d.get("text_config"), dict):
        d = {**d, **d["text_config"]}
    h = int(_key(d, "hidden_size", ("n_embd", "d_model")))
    layers = int(_key(d, "num_hidden_layers", ("n_layer", "num_layers")))
    heads = int(_key(d, "num_attention_heads", ("n_head",)))
    kv = 1 if d.get("multi_query") else int(d.get("num_key_value_heads") or heads)
    hd = int(d.get("head_dim") or h // heads)
    vocab = int(d["vocab_size"])
    inter = int(d.get("intermediate_size") or 4 * h)
    embed = vocab * h * (1 if d.get("tie_word_embeddings", False) else 2)

    mla = parse_mla(d)  # the engine's reading of the MLA keys, defaults included
    if mla is not None:
        q_lora = mla.q_lora_rank
        rope, nope = mla.qk_rope_head_dim, mla.qk_nope_head_dim
        v_dim, kv_lora = mla.v_head_dim, mla.kv_lora_rank
        q = (h * q_lora + q_lora + q_lora * heads * (nope + rope)) if q_lora \
            else h * heads * (nope + rope)
        attn = q + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) \
            + heads * v_dim * h
    else:
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
        if str(d.get("model_type", "")) in ("qwen2", "qwen2_moe") or d.get("attention_bias"):
            attn += heads * hd + 2 * kv * hd  # q, k, v biases (Qwen2 always has them)

    dense_mlp = 3 * h * inter
    experts = d.get("n_routed_experts") or d.get("num_experts") or d.get("num_local_experts")
    if experts:
        moe_inter = int(d.get("moe_intermediate_size") or inter)
        shared = int(d.get("n_shared_experts") or 0) * 3 * h * moe_inter
        shared += 3 * h * int(d.get("shared_expert_intermediate_size") or 0)
        moe_mlp = int(experts) * 3 * h * moe_inter + shared + h * int(experts)
        first_dense = int(d.get("first_k_dense_replace") or 0)
        freq = int(d.get("moe_layer_freq") or d.get("decoder_sparse_step") or 1)
        moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)
        mlp_total = moe_layers * moe_mlp + (layers - moe_layers) * dense_mlp
    else:
        mlp_total = layers * dense_mlp
    norms = layers * 2 * h + h
    return embed + layers * attn + mlp_total + norms


def count_safetensors_params(directory: Path) -> int | None:
    """Exact parameter count from the headers of *.safetensors files (no tensor data is read);
    None when there are none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ValueError(f"cannot read the safetensors header of {str(f)!r}: {e}") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total
