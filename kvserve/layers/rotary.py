"""Rotary position embeddings: the inverse frequencies (with linear, llama3 and YaRN scaling),
the cos | sin table built once per model, and the rotate-half rotation (`apply_rope`), as
transformers computes them. The C++ and Triton RoPE kernels compute the same rotation."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

# a kvserve.models.config.ModelConfig, read by its fields (layers sit below models)
ModelConfig = Any


def rope_inv_freq(config: ModelConfig, theta: float | None = None,
                  scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32), with transformers' linear/llama3 scaling;
    the config's (full layers') RoPE unless `theta` (and `scaling`) are given. With a partial
    `rotary_dim` the frequencies are rotary_dim's, padded with zeros to head_dim / 2: those
    dimensions pass through unrotated (cos 1, sin 0)."""
    inv_freq = _inv_freq(config, theta, scaling)
    pad = config.head_dim // 2 - inv_freq.shape[0]
    return F.pad(inv_freq, (0, pad)) if pad else inv_freq


def _inv_freq(config: ModelConfig, theta: float | None, scaling: dict | None) -> torch.Tensor:
    dim = config.rotary_dim or config.head_dim
    if theta is None:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(theta, dim, factor, scaling)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


def _yarn_inv_freq(base: float, dim: int, factor: float, scaling: dict) -> torch.Tensor:
    """YaRN (DeepSeek's rope_scaling): interpolated frequencies below the correction range,
    extrapolated above, a linear ramp between; transformers' `_compute_yarn_parameters`."""
    def correction_dim(rotations: float) -> float:
        old_len = scaling["original_max_position_embeddings"]
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_cache(config: ModelConfig, device: torch.device | str | None = None,
               theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """[max_position_embeddings, head_dim]: cos of each angle in the first half, sin in the
    second, computed in float32 exactly as transformers computes them per step (times YaRN's
    attention factor, as transformers scales its cos/sin)."""
    if theta is None:
        theta, scaling = config.rope_theta, config.rope_scaling
    inv_freq = rope_inv_freq(config, theta, scaling)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    attention_factor = (scaling or {}).get("attention_factor", 1.0)
    if attention_factor != 1.0:
        cache = cache * attention_factor
    return cache if device is None else cache.to(device)


def identity_rope_cache(config: ModelConfig, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """A table that rotates nothing (cos 1, sin 0 at every position): a layer without RoPE
    (SmolLM3's NoPE layers) runs the same code, kernels that fuse RoPE included, and its q and
    k come out exactly as they went in."""
    half = config.head_dim // 2
    cache = torch.cat((torch.ones(config.max_position_embeddings, half),
                       torch.zeros(config.max_position_embeddings, half)), dim=-1)
    return cache if device is None else cache.to(device)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos_sin [T, D] (cos | sin halves); returns a new tensor."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1 = out[..., :half]
    o2 = out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
