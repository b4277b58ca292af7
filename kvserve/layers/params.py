"""Parameters the model code allocates and the loader fills."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.utils import hugepages


def param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    # Not initialised here: the loader fills every parameter. On the CPU the memory is
    # hugepages.empty's (2 MiB pages asked for before the loader's first write).
    if device is None or torch.device(device).type == "cpu":
        return nn.Parameter(hugepages.empty(shape, dtype), requires_grad=False)
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
