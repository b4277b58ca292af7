"""Pick the attention backend named by `EngineConfig.attention_backend`.

Triton is imported only when asked for, so a CPU install without Triton never needs it."""

from __future__ import annotations

import torch

from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.base import AttentionBackend

BACKENDS = ("torch", "triton")


def make_attention_backend(name: str, pool: KVTensorPool, scale: float,
                           dtype: torch.dtype | None = None,
                           softcap: float | None = None, deterministic: bool = False
                           ) -> AttentionBackend:
    """"torch" (the CPU backend) or "triton" (GPU; on CPU tensors only under TRITON_INTERPRET=1,
    for tests); an MLA latent pool gets the MLA variant of either. `dtype`: the model's;
    `softcap`: Gemma 2's attention logit soft-capping (the torch backend only, so far);
    `deterministic`: batch- and split-invariant attention (the torch backend only)."""
    from kvserve.attention.mla import TorchMLABackend, is_mla_pool

    if softcap is not None and (name != "torch" or is_mla_pool(pool)):
        raise ValueError(f"attention logit soft-capping (Gemma 2's attn_logit_softcapping) runs "
                         f"on attention_backend='torch' only, not {name!r}")
    if is_mla_pool(pool) and name == "torch":
        return TorchMLABackend(pool, scale)
    if is_mla_pool(pool) and name == "triton":
        try:
            from kvserve.attention.mla_triton import TritonMLABackend
        except ImportError as e:
            raise ValueError("attention_backend='triton' needs the triton package "
                             f"(pip install triton): {e}") from e
        return TritonMLABackend(pool, scale)
    if name == "torch":
        from kvserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, scale, dtype, softcap, deterministic)
    if name == "triton":
        try:
            from kvserve.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            raise ValueError("attention_backend='triton' needs the triton package "
                             f"(pip install triton): {e}") from e
        return TritonAttentionBackend(pool, scale)
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
