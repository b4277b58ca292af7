"""How KV is laid out in memory: bytes per token, pool sizing, and the per-layer tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K/V tensors per layer, [num_blocks, block_size, kv_heads, head_dim].

        Zeroed, not empty: masked-out slots still take part in the attention matmuls (weight 0),
        and 0 x NaN from uninitialised memory would poison the output.
        """
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=device),
                 torch.zeros(shape, dtype=self.dtype, device=device))
                for _ in range(self.num_layers)]


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be had without swapping), else total RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
