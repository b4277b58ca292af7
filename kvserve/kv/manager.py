"""Per-request block tables on top of the block pool.

The manager answers the scheduler's one question, "can this request get room for N more tokens?",
and keeps each running request's block table: block i holds the KV of token positions
[i * block_size, (i + 1) * block_size). Allocation is all-or-nothing, so a refused request holds
exactly what it held before.
"""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks still missing to hold the request's computed tokens plus `num_new_tokens`."""
        held = len(self.block_tables.get(request.request_id, ()))
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        missing = self.num_new_blocks(request, num_new_tokens)
        if missing > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        if missing:
            table.extend(self.pool.allocate(missing))
        return True

    def free(self, request: Request) -> None:
        """Give back every block of a finished, aborted or preempted request."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.release(table)

    def block_table(self, request: Request) -> list[int]:
        return self.block_tables[request.request_id]

    def check_invariants(self, requests: list[Request]) -> None:
        """Tables belong to live requests, cover their computed tokens, and match the pool."""
        live = {r.request_id: r for r in requests}
        assert set(self.block_tables) <= set(live), "a block table outlived its request"
        for rid, table in self.block_tables.items():
            need = self.blocks_for_tokens(live[rid].num_computed_tokens)
            assert len(table) >= need, f"request {rid} holds {len(table)} blocks, needs {need}"
        self.pool.check_invariants(self.block_tables.values())
