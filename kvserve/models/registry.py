"""The architecture registry: a Hugging Face architecture name (config.json's
`architectures[0]`, or its `model_type`) -> the family that runs it.

Every component that meets a config.json reads it here: `config_from_dict` / `config_from_dir`
make the engine's `ModelConfig` (the loader's, the planner's), `get(name).family` gives the
model class and the checkpoint weight map (the loader's), `by_make_name` the config.json that
`kvserve make-model --arch` writes. An architecture not listed is one ValueError that names the
supported ones.

Why a module of its own, above the model config: a family needs the model code (its model
class) and the model code needs `ModelConfig`, so the table that reaches every family cannot
sit in `kvserve.models.config`. Reading a config imports no torch: families import their model
class only when it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvserve.models.config import ModelConfig, read_json_object
from kvserve.models import (deepseek, gemma2, gemma3, granite, llama, mixtral, olmo2, phi3,
                            qwen3_moe, smollm3)
from kvserve.models.base import Family


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type
    family: Family
    make_name: str | None = None  # `kvserve make-model --arch` (default: the model_type)

    @property
    def make_arch(self) -> str:
        return self.make_name or self.model_type


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", llama.LLAMA),
    Architecture("Qwen2ForCausalLM", "qwen2", llama.QWEN2),
    Architecture("Qwen3ForCausalLM", "qwen3", llama.QWEN3),
    Architecture("MistralForCausalLM", "mistral", llama.MISTRAL),
    Architecture("Gemma3ForCausalLM", "gemma3_text", gemma3.GEMMA3, make_name="gemma3"),
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", deepseek.DEEPSEEK_V2),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", deepseek.DEEPSEEK_V3),
    Architecture("Phi3ForCausalLM", "phi3", phi3.PHI3),
    Architecture("Olmo2ForCausalLM", "olmo2", olmo2.OLMO2),
    Architecture("GraniteForCausalLM", "granite", granite.GRANITE),
    Architecture("SmolLM3ForCausalLM", "smollm3", smollm3.SMOLLM3),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe.QWEN3_MOE),
    Architecture("MixtralForCausalLM", "mixtral", mixtral.MIXTRAL),
    Architecture("Gemma2ForCausalLM", "gemma2", gemma2.GEMMA2),
)
SUPPORTED_ARCHITECTURES = tuple(a.name for a in ARCHITECTURES)
MAKE_ARCHS = tuple(a.make_arch for a in ARCHITECTURES)
_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES}
_BY_MAKE_NAME = {a.make_arch: a for a in ARCHITECTURES}
_FIELDS = {f.name for f in fields(ModelConfig)}


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


def get(name: str) -> Architecture:
    """The entry of an architecture name (ModelConfig.architecture, architectures[0])."""
    arch = _BY_NAME.get(name)
    if arch is None:
        raise _unsupported(f"unsupported architecture {name!r}")
    return arch


def by_model_type(model_type: str) -> Architecture:
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        raise _unsupported(f"unsupported model_type {model_type!r}")
    return arch


def by_make_name(name: str) -> Architecture:
    arch = _BY_MAKE_NAME.get(name)
    if arch is None:
        raise ValueError(f"arch must be one of {MAKE_ARCHS}, got {name!r}")
    return arch


def lookup(d: dict[str, Any]) -> Architecture:
    """The entry a config.json names: its architectures[0], else its model_type."""
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"'architectures' must be a list of names, got {archs!r}")
        return get(archs[0])
    if d.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[d["model_type"]]
    raise _unsupported("config has no 'architectures' entry and no known 'model_type' "
                       f"(got {d.get('model_type')!r})")


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """The engine's ModelConfig of a config.json dict, by its family's adapter; every problem
    is a ValueError."""
    arch = lookup(d)
    values = arch.family.config(d, arch.name)
    unknown = set(values) - _FIELDS
    assert not unknown, f"{arch.name}'s adapter sets unknown ModelConfig fields {unknown}"
    return ModelConfig(architecture=arch.name, **values)


def config_from_dir(path: str | Path) -> ModelConfig:
    """Read `<path>/config.json`; every problem is a ValueError naming the path."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(config_file)!r} not found: a model directory must hold a "
                         "Hugging Face config.json")
    data = read_json_object(config_file)
    try:
        return config_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{str(config_file)!r}: {e}") from e
