"""One projection's weights as a module (`Linear`): the one owner of a weight from allocation
to the kernel's own copy.

Why: a weight used to have three owners: the layer allocated a float parameter, the loader
found the projection a GGUF tensor belonged to by matching `data_ptr` ranges and set the
layer's attribute to None, and a CPU method freed it by `setattr` on the layer. Now the
projection allocates `weight` (and `bias`), the weight map names the projection each
checkpoint tensor fills (`kvserve.models.base.Target.owner`), the loader hands a weight the
file keeps in its blocks to the projection itself (`take_blocks`), and a method that runs its
own packed or quantized copy frees the float one through the projection (`release`,
`replace`). Nothing outside this class assigns its attributes (tests/test_architecture.py).

Kernel-free: how the projection computes is its layer's method's business (the per-bucket
`LayerMethods` read `weight`, `bias` and `file_blocks`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.layers.params import param


class Linear(nn.Module):
    """weight [out_features, in_features] (+ bias [out_features]) in the plan's dtype and
    device, left for the loader to fill. `role` names the projection for the method source
    ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head", ...):
    whether a file's blocks of it may stay blocks is asked by that name. `blocks`: whether
    the method its owner runs it with has a quantized variant at all (the decoder layer's
    four projections, the embedding table and the LM head; not DeepSeek's)."""

    def __init__(self, out_features: int, in_features: int, plan: Any, role: str,
                 bias: bool = False, blocks: bool = False) -> None:
        super().__init__()
        p = dict(dtype=plan.dtype, device=plan.device)
        self.role, self.blocks = role, blocks
        self.out_features, self.in_features = out_features, in_features
        self.weight: nn.Parameter | None = param(out_features, in_features, **p)
        self.bias: nn.Parameter | None = param(out_features, **p) if bias else None
        # The weight as a quantized file stores it (`quant_formats.FileBlocks`), where the
        # loader handed it over in place of the float weight; the method makes its kernels'
        # layout from it
        self.file_blocks: Any = None

    def take_blocks(self, blocks: Any, keep_float: bool = False) -> None:
        """Keep the file's blocks of this weight; the float weight (never written, so never
        paged in) is dropped unless `keep_float` (a Q8_0 head that runs float x on both)."""
        self.file_blocks = blocks
        if not keep_float:
            self.weight = None

    def release(self) -> None:
        """Drop the float weight: the method runs its own copy (packed, quantized)."""
        self.weight = None

    def replace(self, weight: torch.Tensor) -> None:
        """Hold `weight` (a packed copy the method made) in place of the row-major one."""
        self.weight = nn.Parameter(weight, requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.role}: {self.in_features} -> {self.out_features}"
