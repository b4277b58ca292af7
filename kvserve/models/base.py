"""What the registry holds per architecture (`Family`) and what a weight map is made of
(`Target`).

A family module (`kvserve/models/llama.py`, `phi3.py`, ...) builds one `Family` per
architecture it serves; `kvserve/models/registry.py` names each under its Hugging Face
architecture and model_type. Nothing here imports torch or the model code: reading a
config.json (the planner, the GGUF reader, the gateway) must not pay for them, so a family
imports its model class only when `Family.model` is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvserve.models.config import ModelConfig


@dataclass
class Target:
    """Where one checkpoint tensor goes: a view into a model parameter, the shape the
    checkpoint tensor must have, a constant added after the copy (Gemma's norms are stored as
    1 + w), the part a tensor-parallel rank reads, and a transform applied before it (a row
    permutation: DeepSeek's interleaved RoPE, Phi-3's partial RoPE)."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    offset: float = 0.0
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Tensor parallelism: (dim, start, stop), the range of the checkpoint tensor (of `shape`)
    # this rank reads into `dest` (kvserve/model_loader/tp_shard.py); None reads all of it.
    part: tuple[int, int, int] | None = None
    # The projection (`kvserve.layers.projection.Linear`) whose weight `dest` is whole rows
    # of, from row `first_row`: the loader hands a file's blocks to it (`take_blocks`)
    # instead of finding it by address. None for anything else (norms, biases, experts).
    owner: Any = None
    first_row: int = 0


# (model, config) -> checkpoint tensor name -> Target, in the order make-model draws them
WeightMap = Callable[["nn.Module", "ModelConfig"], dict[str, Target]]


@dataclass(frozen=True)
class Family:
    """One architecture as kvserve runs it:

    * `config`: the config adapter, (HF config dict, architecture name) -> the `ModelConfig`
      fields (everything but `architecture`);
    * `model`: () -> the model class, called as cls(config, dtype, device) with parameters
      left for the loader to fill;
    * `weights`: the checkpoint weight map, (model, config) -> {HF tensor name: Target};
    * `make_config`: make-model's config.json, (size, shape, common keys) -> dict, with shape
      make-model's sizes table entry (hidden_size, layers, heads, ...) and common the keys every
      architecture writes (dtype, token ids, initializer_range, ...);
    * `skip`: checkpoint tensors inference leaves out (DeepSeek-V3's multi-token-prediction
      layers), (tensor name, config) -> bool;
    * `sizes`: the make-model sizes it accepts (None: all of make-model's).
    """

    config: Callable[[dict[str, Any], str], dict[str, Any]]
    model: Callable[[], type]
    weights: WeightMap
    make_config: Callable[[str, dict[str, Any], dict[str, Any]], dict[str, Any]]
    skip: Callable[[str, "ModelConfig"], bool] | None = None
    sizes: tuple[str, ...] | None = None


def decoder_model() -> type:
    """The shared decoder (`kvserve.models.decoder.CausalLM`), for the families it runs."""
    from kvserve.models.decoder import CausalLM

    return CausalLM


def transformers_config(class_name: str, size: str, shape: dict[str, Any],
                        common: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """make-model's config.json made by transformers' own config class (`class_name`), as
    save_pretrained writes it (the keys that differ from the base config's defaults): for the
    families added after make-model's hand-written configs, so that nothing here restates what
    transformers defaults to. head_dim is left to the class (hidden_size / heads)."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"make-model writes this architecture's config.json with transformers' "
                         f"{class_name}: install transformers") from e
    keys = {k: v for k, v in {**common, **shape}.items()
            if k not in ("model_type", "transformers_version", "head_dim")}
    return getattr(transformers, class_name)(**keys, **extra).to_diff_dict()
