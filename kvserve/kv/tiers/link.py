"""The chunk-level rules between the prefix cache and the storage tiers.

The cache thinks in blocks, the tiers in chunks (`chunk_size` tokens = `chunk_blocks` blocks, each
chunk named by its last block's chained hash). This module translates, and decides; it touches
no KV memory and no manager state. What it decides travels as data in the step plan:

* saving: when the index evicts a block that ends a chunk, `save_for_evicted` names the chunk's
  blocks (that block and its ancestors) as a `ChunkSave`; under write-through, `saves_for_computed`
  names each chunk as soon as a request completes it. The runner reads the blocks and hands the KV
  to `save` before anything in the step can overwrite them;
* loading: `continue_match` extends a device match with the whole chunks that host memory holds;
  at admission the manager gives them fresh blocks and puts a `ChunkLoad` in the plan;
* prefetching: when a request arrives, its chunks on disk or in Redis are promoted into host
  memory in the background, and the scheduler lets it wait until that is done or timed out.

`NoTiers` is the same interface with no tiers behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.kv.plan import ChunkSave
from kvserve.kv.prefix_index import Node, PrefixMatch
from kvserve.kv.tiers.tiered import FoundChunk, Prefetch, TieredKVStore


@dataclass
class TieredMatch(PrefixMatch):
    """A device match continued by whole chunks that host memory holds. The chunks live here,
    not in `PrefixMatch`, so the prefix index stays the device's alone; the scheduler reads
    either kind the same way, and the manager admits this one by loading the chunks."""

    chunks: list[FoundChunk] = field(default_factory=list)  # continuing `nodes`
    skip_blocks: int = 0  # leading blocks of the first chunk that `nodes` covers already
    num_loaded_blocks: int = 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.nodes) + self.num_loaded_blocks


class TierLink:
    def __init__(self, tiers: TieredKVStore, block_size: int) -> None:
        chunk = tiers.identity.chunk_size
        if chunk % block_size:
            raise ValueError(f"chunk_size ({chunk}) must be a multiple of block_size "
                             f"({block_size})")
        self.tiers = tiers
        self.block_size = block_size
        self.chunk_blocks = chunk // block_size
        self.write_through = tiers.config.write_policy == "write_through"
        self._prefetches: dict[str, Prefetch] = {}

    def close(self) -> None:
        self._prefetches.clear()

    def chunk_hashes(self, block_hashes: Sequence[int], first_block: int) -> list[int]:
        """The names of the whole chunks among a request's matchable block hashes, from the chunk
        holding block `first_block` on."""
        cb = self.chunk_blocks
        return [block_hashes[(c + 1) * cb - 1]
                for c in range(first_block // cb, len(block_hashes) // cb)]

    # -- saving -----------------------------------------------------------------------------
    def save_for_evicted(self, node: Node) -> ChunkSave | None:
        """The index evicted `node`: if it ends a chunk not saved yet, name the chunk's blocks."""
        cb = self.chunk_blocks
        if node.depth % cb or self.tiers.knows(node.block_hash):
            return None
        blocks = []
        walk: Node | None = node
        for _ in range(cb):
            assert walk is not None
            blocks.append(walk.block)
            walk = walk.parent
        return ChunkSave(node.block_hash, tuple(blocks[::-1]))

    def saves_for_computed(self, table: Sequence[int], hashes: Sequence[int], first: int,
                           end: int) -> list[ChunkSave]:
        """Write-through: the chunks that computing blocks [first, end) completed."""
        if not self.write_through:
            return []
        cb = self.chunk_blocks
        return [ChunkSave(hashes[i], tuple(table[i + 1 - cb:i + 1])) for i in range(first, end)
                if (i + 1) % cb == 0 and not self.tiers.knows(hashes[i])]

    def save(self, chunk_hash: int, data: torch.Tensor) -> None:
        """Hand a chunk's KV (read out by the runner) to the tiers."""
        self.tiers.save(chunk_hash, data)

    # -- loading ----------------------------------------------------------------------------
    def continue_match(self, match: PrefixMatch, block_hashes: Sequence[int]) -> PrefixMatch:
        """Extend a device match with the chunks host memory holds right after it."""
        return self._extend(match, self.tiers.lookup(
            self.chunk_hashes(block_hashes, len(match.nodes))))

    def match_after_prefetch(self, match: PrefixMatch, block_hashes: Sequence[int]
                             ) -> PrefixMatch:
        """A device match continued as a request would find it once its prefetch from disk or
        Redis is done (read-only, nothing is promoted; its chunks carry no KV): the cache
        report's explain."""
        if not self.tiers.has_lower_tiers:
            return self.continue_match(match, block_hashes)
        return self._extend(match, self.tiers.lower_run(
            self.chunk_hashes(block_hashes, len(match.nodes))))

    def _extend(self, match: PrefixMatch, found: list[FoundChunk]) -> PrefixMatch:
        """`match` followed by the chunks found after it (the first one's leading blocks, which
        the device holds already, skipped)."""
        if not found:
            return match
        skip = len(match.nodes) % self.chunk_blocks
        return TieredMatch(match.nodes, block_size=self.block_size, chunks=found,
                           skip_blocks=skip,
                           num_loaded_blocks=len(found) * self.chunk_blocks - skip)

    def loaded_kv(self, match: TieredMatch) -> torch.Tensor:
        """The KV of a match's loaded blocks, in token order (the first chunk's leading blocks,
        which the device holds already, cut off). Dim 2 counts tokens, or blocks for a packed
        pool's chunks ([layers, 1, blocks, 1, page_bytes]): the cut is in its units."""
        chunks = match.chunks
        data = torch.cat([c.data for c in chunks], dim=2) if len(chunks) > 1 else chunks[0].data
        per_block = chunks[0].data.shape[2] // self.chunk_blocks  # block_size, or 1 if packed
        return data[:, :, match.skip_blocks * per_block:]

    def tokens_by_source(self, match: TieredMatch) -> list[tuple[str, int]]:
        """(source, tokens) per loaded chunk, for the hit counters."""
        cb, bs = self.chunk_blocks, self.block_size
        return [(c.source, ((cb - match.skip_blocks) if j == 0 else cb) * bs)
                for j, c in enumerate(match.chunks)]

    def consumed(self, chunks: list[FoundChunk]) -> None:
        self.tiers.consumed(chunks)

    # -- prefetching ------------------------------------------------------------------------
    def start_prefetch(self, request_id: str, block_hashes: Sequence[int],
                       device_blocks: int, peer: str | None = None) -> None:
        """Promote the chunks after the first `device_blocks` blocks from disk/Redis (and the
        instance at `peer` that computed them, for a disaggregated prefill)."""
        if not self.tiers.has_lower_tiers and peer is None:
            return
        handle = self.tiers.prefetch(self.chunk_hashes(block_hashes, device_blocks), peer)
        if handle is not None:
            self._prefetches[request_id] = handle

    def prefetch_pending(self, request_id: str) -> bool:
        handle = self._prefetches.get(request_id)
        if handle is None:
            return False
        if handle.pending:
            return True
        del self._prefetches[request_id]
        return False

    def wait_for_prefetch(self, seconds: float) -> bool:
        for handle in self._prefetches.values():
            if handle.pending:
                handle.wait(seconds)
                return True
        return False

    def forget(self, request_id: str) -> None:
        """The request let go of its blocks: drop its prefetch."""
        self._prefetches.pop(request_id, None)


class NoTiers:
    """No storage tiers: nothing is saved, loaded or prefetched."""

    chunk_blocks = 0

    def close(self) -> None:
        pass

    def save_for_evicted(self, node: Node) -> ChunkSave | None:
        return None

    def saves_for_computed(self, table: Sequence[int], hashes: Sequence[int], first: int,
                           end: int) -> list[ChunkSave]:
        return []

    def save(self, chunk_hash: int, data: torch.Tensor) -> None:
        raise AssertionError("no tiers to save to")

    def continue_match(self, match: PrefixMatch, block_hashes: Sequence[int]) -> PrefixMatch:
        return match  # so no match is ever a TieredMatch, and the three below are never called

    def match_after_prefetch(self, match: PrefixMatch, block_hashes: Sequence[int]
                             ) -> PrefixMatch:
        return match

    def loaded_kv(self, match: TieredMatch) -> torch.Tensor:
        raise AssertionError("no tiers: nothing is loaded")

    def tokens_by_source(self, match: TieredMatch) -> list[tuple[str, int]]:
        return []

    def consumed(self, chunks: list[FoundChunk]) -> None:
        pass

    def start_prefetch(self, request_id: str, block_hashes: Sequence[int],
                       device_blocks: int, peer: str | None = None) -> None:
        pass

    def prefetch_pending(self, request_id: str) -> bool:
        return False

    def wait_for_prefetch(self, seconds: float) -> bool:
        return False

    def forget(self, request_id: str) -> None:
        pass


Tiers = TierLink | NoTiers
