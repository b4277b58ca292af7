"""Write random-weight checkpoints in exactly the Hugging Face layout.

The checkpoints load in kvserve and in transformers alike (`AutoModelForCausalLM.from_pretrained`),
which is what the parity tests and benchmarks rely on. The architecture's registry entry
(`kvserve.models.registry`) writes the config.json; the tensors are those its weight map names,
with the shapes it expects, so make-model cannot write a checkpoint the loader would refuse.
`ensure_default_model` builds the tiny random-weight Qwen2 once per cache directory: the tests'
shared checkpoint.

    python -m kvserve.model_loader.make_model OUT_DIR --arch qwen2 --size small
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.utils.dtypes import DTYPES, to_torch_dtype
from kvserve.layers.plan import ExecutionPlan
from kvserve.models import registry
from kvserve.utils.paths import cache_dir

ARCHS = registry.MAKE_ARCHS
SIZES = ("tiny", "small", "qwen3-0.6b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.2-3b",
         "llama-3.1-8b", "qwen2.5-1.5b")
DEFAULT_ARCH = "qwen2"
DEFAULT_SIZE = "tiny"
_HF_VERSION = "5.24.0"  # the transformers release whose config.json layout this file follows

_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                 max_position_embeddings=2048),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                  max_position_embeddings=8192),
    # The real models' shapes, for GPU benchmarks with random weights.
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, tie_word_embeddings=False),
    # The shapes CPU users run as GGUF files (benchmarks/lab/gguf_models.py converts them
    # with llama.cpp's own tools; the speed-at-scale figures are taken on them).
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True),
}
# A checkpoint over this many bytes is written in shards of about this size (an 8B model's
# 16 GB never sits in memory at once), with model.safetensors.index.json as transformers
# writes it.
SHARD_BYTES = 2 << 30


def hf_config(arch: str, size: str, dtype: str = "float32", bos_token_id: int = 0,
              eos_token_id: int = 2) -> dict[str, Any]:
    """The config.json transformers 5.24 writes for this architecture and size."""
    entry = registry.by_make_name(arch)
    sizes = entry.family.sizes or SIZES
    if size not in sizes:
        raise ValueError(f"size for {arch} must be one of {sizes}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    common = {"architectures": [entry.name],
              **_common_config(entry.model_type, size, dtype, bos_token_id, eos_token_id)}
    return dict(sorted(entry.family.make_config(size, _SHAPES.get(size, {}), common).items()))


def _common_config(model_type: str, size: str, dtype: str, bos_token_id: int,
                   eos_token_id: int) -> dict[str, Any]:
    """The config.json keys every architecture shares."""
    return {
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "dtype": dtype,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        # The tiny model's layers must be able to outvote the tied embedding: at std 0.02 its
        # greedy output just repeats the last prompt token, and tests comparing its outputs
        # could not tell a corrupted cache from a good one.
        "initializer_range": 0.15 if size == "tiny" else 0.02,
        "model_type": model_type,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "transformers_version": _HF_VERSION,
        "use_cache": True,
    }


def random_weights(config: dict[str, Any], seed: int = 0,
                   dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    """All of `random_tensors` in one dict."""
    return dict(random_tensors(config, seed, dtype, device))


def random_tensors(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors, every one the architecture's weight map names: N(0,
    initializer_range) matrices, zero biases, unit norms (0 where the norm scales by 1 + w),
    drawn in the weight map's order, each in the dtype its parameter has (DeepSeek's router
    stays float32, as transformers keeps it). One at a time, so that a writer can flush them.

    The names and shapes come from a model built on the meta device (no memory). `device="cuda"`
    draws on the GPU (a 7B model in seconds instead of minutes; different numbers from the CPU
    draw for the same seed); the tensors are returned on the CPU."""
    model_config = registry.config_from_dict(config)
    family = registry.get(model_config.architecture).family
    model = family.model()(model_config, ExecutionPlan.dense(dtype, "meta"))
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.get("initializer_range", 0.02)
    for name, target in family.weights(model, model_config).items():
        as_dtype = target.dest.dtype
        if len(target.shape) >= 2:
            yield name, torch.empty(target.shape, device=device).normal_(
                0.0, std, generator=gen).to(as_dtype).cpu()
        elif name.endswith("bias"):
            yield name, torch.zeros(target.shape, dtype=as_dtype)
        else:  # a norm weight: 1, stored as 1 - offset
            yield name, torch.full(target.shape, 1.0 - target.offset, dtype=as_dtype)


def save_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], out: Path,
                    shard_bytes: int = SHARD_BYTES) -> None:
    """model.safetensors, or shards of about `shard_bytes` and their index once the tensors
    outgrow one (transformers' names: model-00001-of-00004.safetensors)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    written: list[tuple[Path, list[str]]] = []  # each shard's file and tensor names

    def flush() -> None:
        path = out / f"model-{len(written) + 1:05d}.safetensors.part"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        written.append((path, list(shards[-1])))
        shards[-1] = {}

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    if not written:
        save_file(shards[-1], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    flush()
    weight_map = {}
    for i, (path, names) in enumerate(written, 1):
        final = out / f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(final)
        weight_map.update({name: final.name for name in names})
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def make_model(out_dir: str | Path, arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE,
               seed: int = 0, dtype: str = "float32", with_tokenizer: bool = True,
               device: str = "cpu", overrides: dict[str, Any] | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors (or its shards) and
    (unless `with_tokenizer` is False) tokenizer.json/tokenizer_config.json into `out_dir`.
    `device` is where the random weights are drawn (see `random_tensors`); `overrides` replace
    config.json keys (a benchmark's vocabulary of another tokenizer's size)."""
    out = Path(out_dir)
    bos, eos = 0, 2
    train_tokenizer = None
    if with_tokenizer:
        from kvserve.tokenizer import train as tok

        train_tokenizer = tok.train_tokenizer
        bos, eos = tok.BOS_TOKEN_ID, tok.EOS_TOKEN_ID
    config = {**hf_config(arch, size, dtype, bos, eos), **(overrides or {})}
    torch_dtype = to_torch_dtype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(random_tensors(config, seed, torch_dtype, device), out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "_from_model_config": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": _HF_VERSION,
        "use_cache": True,
    })
    if train_tokenizer is not None:
        train_tokenizer(out, config["vocab_size"],
                        model_max_length=config["max_position_embeddings"])
    return out


# Bump when make_model or the tokenizer trainer changes what they write (3: the chat
# template renders tool calls and tool results), so that a cached default
# model from an older kvserve is not reused.
DEFAULT_MODEL_VERSION = 3


def default_model_path() -> Path:
    """$KVSERVE_CACHE_DIR (default ~/.cache/kvserve) / default-qwen2-tiny-v<N>."""
    return cache_dir() / f"default-{DEFAULT_ARCH}-{DEFAULT_SIZE}-v{DEFAULT_MODEL_VERSION}"


# The trained model kvserve ships as package data (scripts/train_model.py makes it): no longer
# the default (kvserve.model_loader.default is), kept as the asset that shows training reproduces.
TRAINED_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "stdlib-coder"


def ensure_default_model() -> Path:
    """Create the tiny random-weight model once and return its directory.

    It is built in a private temporary directory next to the target and renamed into place, so a
    reader never sees a half-written model and two processes racing here both end up with one
    complete copy (the loser of the rename discards its own).
    """
    path = default_model_path()
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        make_model(tmp, DEFAULT_ARCH, DEFAULT_SIZE, seed=0)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight HF checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    print(make_model(args.out_dir, args.arch, args.size, args.seed, args.dtype))


if __name__ == "__main__":
    main()
