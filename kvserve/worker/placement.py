"""A plan's token placements (document reuse, kvserve/blend/): a stored document's KV, computed
at positions from the separator's end, copied into a request's slots at its actual positions.

Values do not depend on position; keys carry RoPE's rotation of their position. Rotations
compose (R(p + s) = R(s) R(p), the same frequencies), so a key computed at p becomes the key
at p + s by one more rotation through s: exactly, up to rounding, what computing it at p + s
would give from the same hidden state. The rotation through s is read from the model's own
cos/sin table (its scaling, partial rotary dimensions and no-RoPE layers included), divided by
its magnitude: YaRN scales cos and sin by an attention factor, which the stored key carries
already.
"""

from __future__ import annotations

import torch

from kvserve.kv.plan import TokenPlacement
from kvserve.kv.tensors import KVTensorPool
from kvserve.layers.rotary import apply_rope


def rotation(table: torch.Tensor, shift: int) -> torch.Tensor:
    """The [1, head_dim] cos | sin row that rotates by `shift` positions (negative: back)."""
    row = table[abs(shift)].float()
    half = row.shape[0] // 2
    cos, sin = row[:half], row[half:]
    norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
    sign = -1.0 if shift < 0 else 1.0
    return torch.cat((cos / norm, sign * sin / norm))[None]


def place_tokens(pool: KVTensorPool, tables: list[torch.Tensor], table_of_layer: list[int],
                 placements: list[TokenPlacement]) -> None:
    """Run the placements on a float pool (the feature table refuses quantized ones):
    `tables` are the model's RoPE tables, `table_of_layer[i]` layer i's."""
    for placement in placements:
        src = placement.src.to(pool.device)
        dst = placement.dst.to(pool.device)
        rotations = [rotation(t, placement.shift).to(pool.device) for t in tables]
        for layer, tensors in enumerate(pool.layers):
            k_cache, v_cache = tensors
            heads, dim = k_cache.shape[2], k_cache.shape[3]
            k_flat = k_cache.view(-1, heads, dim)
            v_flat = v_cache.view(-1, heads, dim)
            # (indexing, not index_select/index_copy_: those split a few hundred rows over
            # the OpenMP threads, whose barrier costs milliseconds whenever another process
            # holds a core; measured 8 ms against 0.2 ms for 600 rows on a busy 2-core machine)
            keys = k_flat[src].float()
            turned = apply_rope(keys, rotations[table_of_layer[layer]].expand(keys.shape[0], -1))
            k_flat[dst] = turned.to(k_flat.dtype)
            v_flat[dst] = v_flat[src]
