"""How the KV cache manager reaches the storage tiers.

The manager stays about blocks; this is the part that thinks in chunks (`chunk_size` tokens =
`chunk_blocks` blocks, each named by its last block's chained hash):

* saving: when the prefix index is about to evict a block that ends a chunk, the chunk's blocks
  (that block and its ancestors, all still cached) are read out and saved; under write-through,
  chunks are saved as soon as a request computes them;
* loading: a device match goes on through the chunks that host memory holds (`CacheMatch`); at
  admission those get fresh blocks, are inserted into the index like computed blocks, and their
  contents are queued for the runner to write before the next forward;
* prefetching: when a request arrives, its chunks on disk or in Redis are promoted into host
  memory in the background, and the scheduler lets it wait until that is done or timed out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.kv.hashing import extra_keys
from kvserve.kv.prefix_index import Node, PrefixMatch
from kvserve.request import Request

if TYPE_CHECKING:
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.tiers.tiered import FoundChunk, Prefetch, TieredKVStore
    from kvserve.model.attention.base import AttentionBackend


@dataclass
class CacheMatch(PrefixMatch):
    """A device match continued by whole chunks found in host memory."""

    loaded: list["FoundChunk"] = field(default_factory=list)
    skip_blocks: int = 0  # leading blocks of the first chunk that the device match covers
    num_loaded_blocks: int = 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.nodes) + self.num_loaded_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_full_blocks * self.block_size + self.partial_len


class TierLink:
    def __init__(self, kv: "KVCacheManager", tiers: "TieredKVStore",
                 kv_io: "AttentionBackend") -> None:
        if kv.index is None:
            raise ValueError("storage tiers need prefix caching: enable_prefix_caching=True")
        chunk = tiers.identity.chunk_size
        if chunk % kv.block_size:
            raise ValueError(f"chunk_size ({chunk}) must be a multiple of block_size "
                             f"({kv.block_size})")
        self.kv = kv
        self.index = kv.index
        self.tiers = tiers
        self.kv_io = kv_io  # reads and writes block contents
        self.block_size = kv.block_size
        self.chunk_blocks = chunk // kv.block_size
        self.write_through = tiers.config.write_policy == "write_through"
        self._pending_loads: dict[str, tuple[list[int], torch.Tensor]] = {}  # by request
        self._prefetches: dict[str, Prefetch] = {}
        self.index.on_evict = self.save_evicted

    def close(self) -> None:
        self.index.on_evict = None
        self._pending_loads.clear()
        self._prefetches.clear()

    def chunk_hashes(self, request: Request, first_block: int) -> list[int]:
        """Hashes naming the whole chunks of a request's prompt (less its last token), from the
        chunk holding block `first_block` on: each chunk goes by its last block's hash."""
        cb = self.chunk_blocks
        num_chunks = (request.num_tokens - 1) // self.block_size // cb
        hashes = self.kv.block_hashes(request, num_chunks * cb)
        return [hashes[(c + 1) * cb - 1] for c in range(first_block // cb, num_chunks)]

    # -- saving -----------------------------------------------------------------------------
    def save_evicted(self, node: Node) -> None:
        """The index is about to evict `node`: if it ends a chunk, save the chunk below."""
        cb = self.chunk_blocks
        if node.depth % cb or self.tiers.knows(node.block_hash):
            return
        blocks = []
        walk: Node | None = node
        for _ in range(cb):
            assert walk is not None
            blocks.append(walk.block)
            walk = walk.parent
        self.tiers.save(node.block_hash, self.kv_io.read_blocks(blocks[::-1]))

    def save_computed(self, table: list[int], hashes: list[int], first: int, end: int) -> None:
        """Write-through: save the chunks that blocks [first, end) completed."""
        if not self.write_through:
            return
        cb = self.chunk_blocks
        for i in range(first, end):
            if (i + 1) % cb == 0 and not self.tiers.knows(hashes[i]):
                self.tiers.save(hashes[i], self.kv_io.read_blocks(table[i + 1 - cb:i + 1]))

    # -- loading ----------------------------------------------------------------------------
    def continue_match(self, request: Request, match: PrefixMatch) -> PrefixMatch:
        found = self.tiers.lookup(self.chunk_hashes(request, len(match.nodes)))
        if not found:
            return match
        skip = len(match.nodes) % self.chunk_blocks
        return CacheMatch(match.nodes, block_size=self.block_size, loaded=found,
                          skip_blocks=skip,
                          num_loaded_blocks=len(found) * self.chunk_blocks - skip)

    def admit_loaded(self, request: Request, match: CacheMatch, table: list[int]) -> Node:
        """Give the request fresh blocks for its chunks from host memory, queue their contents
        for the runner, and insert them into the index; returns the deepest node."""
        bs, first = self.block_size, len(match.nodes)
        blocks = self.kv.pool.allocate(match.num_loaded_blocks)
        data = torch.cat([c.data for c in match.loaded], dim=2) if len(match.loaded) > 1 \
            else match.loaded[0].data
        self._pending_loads[request.request_id] = (blocks, data[:, :, match.skip_blocks * bs:])
        table.extend(blocks)
        hashes = self.kv.block_hashes(request, first + len(blocks))
        node = match.last_node or self.index.root(extra_keys(request.cache_salt))
        for i in range(first, first + len(blocks)):
            node = self.index.insert(node, request.token_ids[i * bs:(i + 1) * bs], hashes[i],
                                     table[i], request.priority)
            assert node.block == table[i], "a loaded chunk is on the device already"
        for j, chunk in enumerate(match.loaded):
            used = self.chunk_blocks - match.skip_blocks if j == 0 else self.chunk_blocks
            self.kv.hit_tokens[chunk.source] += used * bs
        self.tiers.consumed(match.loaded)
        return node

    def apply_pending_loads(self, write_blocks: Callable[[list[int], torch.Tensor], None]) -> None:
        loads, self._pending_loads = self._pending_loads, {}
        for blocks, data in loads.values():
            write_blocks(blocks, data)

    # -- prefetching ------------------------------------------------------------------------
    def start_prefetch(self, request: Request) -> None:
        if not self.tiers.has_lower_tiers or request.num_tokens <= 1:
            return
        limit = request.num_tokens - 1
        device = self.index.match(request.token_ids[:limit],
                                  self.kv.block_hashes(request, limit // self.block_size),
                                  extra_keys(request.cache_salt))
        handle = self.tiers.prefetch(self.chunk_hashes(request, len(device.nodes)))
        if handle is not None:
            self._prefetches[request.request_id] = handle

    def prefetch_pending(self, request: Request) -> bool:
        handle = self._prefetches.get(request.request_id)
        if handle is None:
            return False
        if handle.pending:
            return True
        del self._prefetches[request.request_id]
        return False

    def wait_for_prefetch(self, seconds: float) -> bool:
        for handle in self._prefetches.values():
            if handle.pending:
                handle.wait(seconds)
                return True
        return False

    def forget(self, request: Request) -> None:
        """The request lets go of its blocks (called before they are released): drop its
        prefetch, and write its loads if they are still queued. That happens only when a step
        failed between the request's admission and the runner (the engine then aborts it);
        its loaded blocks are in the prefix index already, and dropping the load would leave
        them there, idle, holding whatever the blocks held before, for the next hit."""
        pending = self._pending_loads.pop(request.request_id, None)
        if pending is not None:
            self.kv_io.write_blocks(*pending)
        self._prefetches.pop(request.request_id, None)
