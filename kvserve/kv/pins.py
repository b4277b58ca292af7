"""Pins: prefixes kept on the device until unpinned, whatever the eviction policy or a burst does.

A pin holds its blocks the way a running request does (a reference on each, kv/block_pool.py):
a held block is never an eviction candidate, and neither is anything above it in the prefix
tree, so no policy needs to know about pins and no burst can take a pinned block. Unpinning lets
go of the references, and the blocks become idle cached blocks like any finished request's.

What can be pinned is bounded (`max_fraction` of the pool, counting a block pinned twice once),
so pins cannot starve the requests that need fresh blocks: a pin past the bound is refused with
an error naming it, before any prefill is spent on it.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.seq import CachedSeq


class PinLimitError(ValueError):
    """A pin that would take more of the pool than `--max-pinned-fraction` allows."""


@dataclass
class Pin:
    id: str
    num_tokens: int  # the prompt tokens whose blocks are pinned (whole blocks)
    blocks: list[list[int]]  # per KV group
    created: float = field(default_factory=time.time)
    cache_salt: str | None = None
    owner: str = ""  # who may see and release it besides the admin ("": no credential)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "cache.pin", "created": int(self.created),
                "num_tokens": self.num_tokens,
                "num_blocks": sum(len(b) for b in self.blocks), "owner": self.owner or None}


class Pins:
    """The pins of one KV cache manager (`KVCacheManager.pins`)."""

    def __init__(self, manager: Any, max_fraction: float = 0.5) -> None:
        self.manager = manager
        self.max_fraction = max_fraction
        self._pins: dict[str, Pin] = {}
        self._count: Counter[int] = Counter()  # pins per block
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def limit_blocks(self) -> int:
        return int(self.max_fraction * self.manager.num_blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._count)

    def set_max_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {fraction}")
        self.max_fraction = fraction

    def check_room(self, num_new_blocks: int) -> None:
        """Refuse a pin of up to `num_new_blocks` more blocks past the limit (an upper bound:
        blocks pinned already count once)."""
        total = self.num_pinned_blocks + num_new_blocks
        if total > self.limit_blocks:
            raise PinLimitError(
                f"pinning {num_new_blocks} more blocks would pin {total} of the pool's "
                f"{self.manager.num_blocks}, over --max-pinned-fraction {self.max_fraction} "
                f"({self.limit_blocks} blocks); unpin something or raise the limit")

    def pin(self, seq: CachedSeq, num_tokens: int, owner: str = "") -> Pin | None:
        """Pin the cached blocks of `seq`'s first `num_tokens` tokens (whole blocks): a Pin, or
        None if the device does not hold them all (compute them first, then pin)."""
        m = self.manager
        num_blocks = num_tokens // m.block_size
        match = m.device_match(seq)
        if match.num_full_blocks < num_blocks:
            return None
        groups = match.group_nodes or [match.nodes]
        blocks = [[n.block for n in nodes[:num_blocks] if n.block != NULL_BLOCK]
                  for nodes in groups]
        new = {b for bs in blocks for b in bs if b not in self._count}
        self.check_room(len(new))
        for bs in blocks:
            m.pool.share(bs)
            self._count.update(bs)
        pin = Pin(f"pin-{next(self._ids)}", num_blocks * m.block_size, blocks,
                  cache_salt=seq.cache_salt, owner=owner)
        self._pins[pin.id] = pin
        return pin

    def unpin(self, pin_id: str, owner: str | None = None) -> Pin | None:
        """Let a pin go (its blocks stay cached, idle); None if there is no such pin, or it is
        not `owner`'s (None: whoever made it)."""
        pin = self._pins.get(pin_id)
        if pin is None or (owner is not None and pin.owner != owner):
            return None
        del self._pins[pin_id]
        for g, bs in zip(self.manager.groups, pin.blocks):
            self._count.subtract(bs)
            g.index.mark_idle(self.manager.pool.release(bs))
        self._count = +self._count
        return pin

    def list(self, owner: str | None = None) -> list[Pin]:
        """The pins, or `owner`'s only."""
        return [p for p in self._pins.values() if owner is None or p.owner == owner]

    def clear(self) -> None:
        for pin_id in list(self._pins):
            self.unpin(pin_id)

    def holders(self) -> Sequence[list[int]]:
        """Every pin's blocks, as block-table-like holders (the manager's invariants)."""
        return [bs for pin in self._pins.values() for bs in pin.blocks]
