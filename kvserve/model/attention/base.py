"""The attention-backend interface: the only place where CPU and GPU code differ.

The runner describes one step as flat tensors (`AttentionMetadata`): which cache slot each new
token's K/V goes to, and, per sequence, its block table and length. The model never sees blocks,
pools or policies: it is handed an `AttentionFn` that maps (layer, q, k, v) to the attention
output for this step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

# (layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SequenceSlice:
    """One sequence's part of a step: its new tokens are rows [start, start + query_len)."""

    start: int
    query_len: int
    seq_len: int  # KV length after this step: cached context + query_len
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Per-step description of a flat batch, built once and read by every layer.

    Sequences with more than one new token (prefill chunks) come first, then single-token
    decodes, so that decodes form one contiguous tail that a backend can batch.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    prefills: list[SequenceSlice]
    decodes: list[SequenceSlice]
    num_prefill_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)


class AttentionBackend(ABC):
    """Owns the per-layer paged K/V tensors and computes attention over them."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 scale: float) -> None:
        self.kv_caches = kv_caches  # per layer: (k, v), each [num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.scale = scale

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> object:
        """Build whatever per-step state the backend needs (gather indices, masks) once."""

    @abstractmethod
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, state: object) -> torch.Tensor:
        """Write k/v into their slots, then attend q over each sequence's cached KV."""

    def bind(self, meta: AttentionMetadata) -> AttentionFn:
        """The attention function the model calls for this step."""
        state = self.prepare(meta)

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            return self.forward(layer_idx, q, k, v, meta, state)

        return attend

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        for k_cache, v_cache in self.kv_caches:
            k_cache[d] = k_cache[s]
            v_cache[d] = v_cache[s]

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """The KV of whole blocks, every layer, as one contiguous host tensor
        [layers, 2, len(blocks) * block_size, Hkv, D] (what a storage tier saves)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv_caches[0][0].device)
        out = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                           for k, v in self.kv_caches])
        return out.flatten(2, 3).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Put KV read by `read_blocks` (same shape) back into the given blocks (a tier load)."""
        k0 = self.kv_caches[0][0]
        idx = torch.tensor(blocks, dtype=torch.long, device=k0.device)
        data = data.to(device=k0.device, dtype=k0.dtype, non_blocking=True)
        data = data.unflatten(2, (len(blocks), self.block_size))
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            k_cache.index_copy_(0, idx, data[layer, 0])
            v_cache.index_copy_(0, idx, data[layer, 1])
