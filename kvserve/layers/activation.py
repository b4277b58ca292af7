"""The gated MLP's activation: act(gate) * up on one [T, 2i] gate | up GEMM output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated(gate_up: torch.Tensor, i: int, gelu: bool) -> torch.Tensor:
    """[T, 2i] gate | up -> act(gate) * up, act SiLU or (Gemma) GELU-tanh; reuses the gate."""
    gate = gate_up[:, :i]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return act.mul_(gate_up[:, i:])
