"""A plain PyTorch paged attention: the ground truth the Triton kernel tests compare against.

Only tests read it, so it lives with them rather than in the engine; it gathers a sequence's
blocks, repeats the KV heads for GQA/MQA and applies the causal mask in float32, with no tricks
that could share a bug with the kernels under test.
"""

from __future__ import annotations

import math

import torch


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: list[int], seq_len: int, scale: float,
                              window: int | None = None) -> torch.Tensor:
    """q [n, H, D] = the last n tokens of a sequence of seq_len tokens; float32 result. With a
    `window` W, a query at position p sees keys p - W < k <= p (transformers'
    `sliding_window_overlay`: `kv_idx > q_idx - sliding_window`)."""
    n, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    blocks = torch.tensor(block_table[: math.ceil(seq_len / bs)], dtype=torch.long,
                          device=k_cache.device)
    k = k_cache.index_select(0, blocks).reshape(-1, hkv, d)[:seq_len].float()
    v = v_cache.index_select(0, blocks).reshape(-1, hkv, d)[:seq_len].float()
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
