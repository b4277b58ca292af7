"""Scaled dot-product attention with tanh soft-capping of the scores (Gemma 2's
`attn_logit_softcapping`: scores = cap * tanh(q.k * scale / cap), before the mask and the
softmax, as transformers' eager path computes them). PyTorch's SDPA has no such option, so
with a cap the product, the cap, the mask and the softmax run as separate ops; without one
this is SDPA itself. The torch backend calls it wherever it attends."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
         attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float,
         softcap: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa=True),
    q [..., Hq, L, D], k and v [..., Hkv, S, D], with the scores soft-capped where `softcap`
    is set (a boolean mask keeps True; a float mask is added; `is_causal` is SDPA's
    top-left causal mask)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores = scores.div_(softcap).tanh_().mul_(softcap)
    if is_causal:
        length, span = scores.shape[-2], scores.shape[-1]
        attn_mask = torch.ones(length, span, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(weights, v)
