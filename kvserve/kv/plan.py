"""What the cache must do to KV memory before a step's forward pass, as data.

Scheduling decides which blocks are reused, shared and filled; it touches no memory. Everything
that reads or writes block contents is recorded here and executed by the runner in one place, in
one fixed order, before the forward:

1. saves:  chunks of evicted (or newly computed, under write-through) blocks are read out for the
           storage tiers, and a swapped-out request's blocks for host swap space (kv/swap.py) —
           first, because their blocks may be reused in this very step;
2. loads:  chunks found in the tiers are written into the blocks given to them;
3. copies: partially matched blocks are copied into the requester's own block (copy-on-write) —
           after the loads, because the source may be a block that a load fills in this step;
   placements: a stored document's KV is copied token by token into a blended request's slots,
           its keys rotated to their new positions (kvserve/blend/) — after the copies, which
           may fill the block a placement writes part of;
4. compactions: a bounded cache's kept tokens move from the blocks it let go to its fresh ones
           (kvserve.engine.bounded_kv) — in the plan handed out right after the forward that
           chose them, before anything can allocate the old blocks again.

`released` names the blocks whose last holder let go since the last plan: per-block state the
worker's codecs keep beside the KV (int4's full-precision residual rows) is dropped for them.
It stays empty (nothing is recorded) unless the KV format keeps such state
(`KVCacheManager(track_released=...)`, from the pool's `keeps_block_state`).

Within a step nothing else writes a block before the forward, so this order is the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ChunkSave:
    """Save the KV of `blocks` (one chunk, in token order) under `chunk_hash`."""

    chunk_hash: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SwapOut:
    """Read the KV of `blocks` (a preempted request's, in table order) into host swap space."""

    request_id: str
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ChunkLoad:
    """Write `data` (a tier chunk's KV, [layers, tensors, tokens, heads, width]) into `blocks`."""

    blocks: tuple[int, ...]
    data: torch.Tensor


@dataclass(frozen=True)
class KVMove:
    """Copy tokens `keep` of a sequence's old blocks into the first slots of its new ones."""

    src_table: list[int]
    keep: torch.Tensor  # [n], [kv_heads, n] or [layers, kv_heads, n] token indices
    dst_table: list[int]


@dataclass(frozen=True)
class TokenPlacement:
    """Copy the KV of slots `src` into slots `dst` (one int64 index each, same length), every
    layer, the keys rotated by RoPE through `shift` positions (document reuse)."""

    src: torch.Tensor
    dst: torch.Tensor
    shift: int


@dataclass
class StepPlan:
    saves: list[ChunkSave] = field(default_factory=list)
    swap_outs: list[SwapOut] = field(default_factory=list)
    loads: list[ChunkLoad] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)
    compactions: list[KVMove] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    placements: list[TokenPlacement] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.swap_outs or self.loads or self.copies or self.compactions
                    or self.released or self.placements)
