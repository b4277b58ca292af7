"""The one table of floating-point dtype names, shared by the engine, the model loader, the
checkpoint writer and the planner.

Users and checkpoints spell the same three dtypes several ways ("bf16", "half", "float");
every component used to carry its own alias map, and the maps had drifted apart. Here each
spelling resolves once, to torch's name (the engine's canonical form) or to the planner's short
form. No torch import at module level: the planner and the CLI stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch's names: what EngineConfig.dtype, ModelConfig.torch_dtype and config.json hold.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                 "bf16": "bfloat16"}
# The planner's (and vLLM's --kv-cache-dtype) short names.
_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def canonical_dtype(name: str) -> str | None:
    """torch's name for any spelling of a supported dtype, None for anything else."""
    name = DTYPE_ALIASES.get(name, name)
    return name if name in DTYPES else None


def short_dtype_name(name: str) -> str | None:
    """fp32 / bf16 / fp16 for any spelling of a supported dtype, None for anything else."""
    canonical = canonical_dtype(name)
    return None if canonical is None else _SHORT_NAMES[canonical]


def to_torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of any spelling of a supported dtype; ValueError for anything else."""
    import torch

    canonical = canonical_dtype(name)
    if canonical is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, canonical)
