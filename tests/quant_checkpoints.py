"""Float safetensors checkpoints for the quantize-at-load tests (issue 31): the default model
(SmolLM2-135M, Q4_1 GGUF) dequantized once into a Hugging Face float32 checkpoint, and the
reference a quantized model is compared with: the same checkpoint with its projections
replaced by what `gguf.quants.dequantize` (ggml's reference decoder, not kvserve's kernel)
makes of the model's blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
               "o_proj": ("self_attn", ("o_proj",)),
               "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
               "down_proj": ("mlp", ("down_proj",))}


def default_float_checkpoint(out: Path) -> Path:
    """The default GGUF model as a float32 Llama checkpoint in `out` (model.safetensors,
    config.json, the tokenizer files): kvserve's dequantized load, written under Hugging
    Face's names (q, k, v and gate, up split again; the embedding tied)."""
    from gguf_files import smollm2_path

    from kvserve.model_loader.gguf_checkpoint import open_gguf
    from kvserve.worker.model_build import load_model

    gguf = open_gguf(smollm2_path())
    model, config = load_model(smollm2_path(), "float32", quantization="none",
                               pack_weights=False)
    c = config
    sizes = {"qkv_proj": (c.q_size, c.kv_size, c.kv_size),
             "gate_up_proj": (c.intermediate_size, c.intermediate_size)}
    tensors = {"model.embed_tokens.weight": model.embed_tokens.weight,
               "model.norm.weight": model.norm}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = layer.input_layernorm
        tensors[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
        for attr, (module, names) in PROJECTIONS.items():
            w = getattr(layer, attr).weight
            parts = w.split(sizes[attr]) if attr in sizes else (w,)
            for name, part in zip(names, parts):
                tensors[f"{p}{module}.{name}.weight"] = part
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        if (gguf.dir / name).is_file():
            shutil.copy(gguf.dir / name, out / name)
    return out


def dequantized_checkpoint(model, float_dir: Path, out: Path) -> Path:
    """`float_dir`'s checkpoint with every projection `model` holds as blocks replaced by
    gguf.quants' dequantization of those blocks: the float model a quantized one must match."""
    from gguf import GGMLQuantizationType, quants

    tensors = load_file(str(float_dir / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    inter = config["intermediate_size"]
    sizes = {"qkv_proj": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
             "gate_up_proj": (inter, inter)}
    for i, layer in enumerate(model.layers):
        for attr, w in (getattr(layer, "quant_weights", None) or {}).items():
            raw = w.row_blocks().numpy()
            full = quants.dequantize(raw, getattr(GGMLQuantizationType, w.type_name))
            full = torch.from_numpy(np.ascontiguousarray(full, dtype=np.float32)).view(w.n, w.k)
            module, names = PROJECTIONS[attr]
            parts = full.split(sizes[attr]) if attr in sizes else (full,)
            for name, part in zip(names, parts):
                key = f"model.layers.{i}.{module}.{name}.weight"
                assert tensors[key].shape == part.shape, key
                tensors[key] = part.contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in float_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    return out
