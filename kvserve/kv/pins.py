"""Pins: prefixes kept on the device until unpinned, whatever the eviction policy or a burst does.

A pin holds its blocks the way a running request does (a reference on each, kv/block_pool.py):
a held block is never an eviction candidate, and neither is anything above it in the prefix
tree, so no policy needs to know about pins and no burst can take a pinned block. Unpinning lets
go of the references, and the blocks become idle cached blocks like any finished request's.

What can be pinned is bounded twice, so that pins cannot starve the requests that need fresh
blocks, nor one tenant another tenant's pins:

* each tenant (a pin's `owner`: the digest of the caller's API key, "" without one) may hold
  `max_fraction` of the pool (`--max-pinned-fraction`); a tenant's count is the blocks its own
  pins hold, a block pinned twice by it counted once. A block that two tenants pin counts in
  both tenants' budgets: each holds it, and would still hold it were the other to unpin, so
  riding on another tenant's pin must not be free (nor would it stay free);
* all tenants together may hold `max_total_fraction` (`--max-pinned-total-fraction`), each
  block counted once (it takes one block of the pool, however many pins hold it).

A pin past either bound is refused with an error, before any prefill is spent on it. The error
names the caller's own count and budget only; past the total cap it says that the server-wide
cap is reached, without other tenants' numbers. Pin ids are random (96 bits): an id says
nothing of how many pins were made, nor leads to another caller's pin.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.seq import CachedSeq

PIN_ID_BYTES = 12  # 96 random bits: not guessable, not a count


class PinLimitError(ValueError):
    """A pin past the tenant's `--max-pinned-fraction` or the total
    `--max-pinned-total-fraction`."""


def new_pin_id() -> str:
    return "pin-" + secrets.token_hex(PIN_ID_BYTES)


def check_pin_fractions(fraction: float, total: float) -> None:
    """Both shares in [0, 1], a tenant's no larger than all tenants' (a per-tenant share over
    the total could never be used: a clear error says so instead)."""
    for name, value in (("max_pinned_fraction", fraction), ("max_pinned_total_fraction", total)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if fraction > total:
        raise ValueError(f"--max-pinned-fraction {fraction} (each tenant's) is over "
                         f"--max-pinned-total-fraction {total} (all tenants'): raise the total "
                         "too")


@dataclass
class Pin:
    id: str
    num_tokens: int  # the prompt tokens whose blocks are pinned (whole blocks)
    blocks: list[list[int]]  # per KV group
    created: float = field(default_factory=time.time)
    cache_salt: str | None = None
    owner: str = ""  # the tenant: who may see and release it besides the admin ("": no key)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "cache.pin", "created": int(self.created),
                "num_tokens": self.num_tokens,
                "num_blocks": sum(len(b) for b in self.blocks), "owner": self.owner or None}


class Pins:
    """The pins of one KV cache manager (`KVCacheManager.pins`)."""

    def __init__(self, manager: Any, max_fraction: float = 0.5,
                 max_total_fraction: float | None = None) -> None:
        self.manager = manager
        self.max_fraction = max_fraction
        self.max_total_fraction = max_fraction if max_total_fraction is None \
            else max_total_fraction
        self._pins: dict[str, Pin] = {}
        self._count: Counter[int] = Counter()  # pins per block, all tenants
        self._by_owner: dict[str, Counter[int]] = {}  # pins per block, per tenant

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def limit_blocks(self) -> int:
        """Each tenant's budget, in blocks."""
        return int(self.max_fraction * self.manager.num_blocks)

    @property
    def total_limit_blocks(self) -> int:
        """All tenants' budget together, in blocks."""
        return int(self.max_total_fraction * self.manager.num_blocks)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by any pin, each counted once (the pool's view)."""
        return len(self._count)

    def owner_blocks(self, owner: str) -> int:
        """Blocks held by `owner`'s pins, each counted once."""
        return len(self._by_owner.get(owner, ()))

    def set_max_fraction(self, fraction: float, total: float | None = None) -> None:
        """Each tenant's share, and all tenants' (None: the same as `fraction`, one tenant's
        view: the offline API and the simulator)."""
        total = fraction if total is None else total
        check_pin_fractions(fraction, total)
        self.max_fraction, self.max_total_fraction = fraction, total

    def check_room(self, num_new_blocks: int, owner: str = "",
                   num_new_total: int | None = None) -> None:
        """Refuse a pin by `owner` of up to `num_new_blocks` blocks new to its pins, and
        `num_new_total` new to all pins (None: as many), past either limit (upper bounds:
        blocks pinned already count once)."""
        own = self.owner_blocks(owner) + num_new_blocks
        if own > self.limit_blocks:
            raise PinLimitError(
                f"pinning {num_new_blocks} more blocks would make your pins hold {own} blocks, "
                f"over your budget of {self.limit_blocks} (--max-pinned-fraction "
                f"{self.max_fraction} of the pool's {self.manager.num_blocks} blocks, per "
                "tenant); unpin one of yours or ask for a higher limit")
        extra = num_new_blocks if num_new_total is None else num_new_total
        if self.num_pinned_blocks + extra > self.total_limit_blocks:
            raise PinLimitError(
                f"pinning {num_new_blocks} more blocks is within your budget, but the server's "
                f"cap on pins across all tenants is reached (--max-pinned-total-fraction "
                f"{self.max_total_fraction}); retry later, or ask the operator to raise it")

    def check_seq_room(self, seq: CachedSeq, num_blocks: int, owner: str = "") -> None:
        """`check_room` for a pin of `seq`'s first `num_blocks` blocks, before it is computed:
        the blocks the device holds already count only where they are new (to `owner`'s pins,
        to all pins), the others as new to both. Why exact: the common pin is a shared system
        prompt, and a second tenant pinning what a first one holds adds nothing to the total."""
        match = self.manager.device_match(seq)
        held = min(num_blocks, match.num_full_blocks)
        mine = self._by_owner.get(owner, Counter())
        new_own = new_total = 0
        for nodes in match.group_nodes or [match.nodes]:
            blocks = [n.block for n in nodes[:held] if n.block != NULL_BLOCK]
            new_own += num_blocks - held + sum(b not in mine for b in blocks)
            new_total += num_blocks - held + sum(b not in self._count for b in blocks)
        self.check_room(new_own, owner, new_total)

    def pin(self, seq: CachedSeq, num_tokens: int, owner: str = "") -> Pin | None:
        """Pin the cached blocks of `seq`'s first `num_tokens` tokens (whole blocks) for
        `owner`: a Pin, or None if the device does not hold them all (compute them first,
        then pin)."""
        m = self.manager
        num_blocks = num_tokens // m.block_size
        match = m.device_match(seq)
        if match.num_full_blocks < num_blocks:
            return None
        groups = match.group_nodes or [match.nodes]
        blocks = [[n.block for n in nodes[:num_blocks] if n.block != NULL_BLOCK]
                  for nodes in groups]
        mine = self._by_owner.get(owner, Counter())
        wanted = {b for bs in blocks for b in bs}
        self.check_room(len(wanted - mine.keys()), owner, len(wanted - self._count.keys()))
        for bs in blocks:
            m.pool.share(bs)
            self._count.update(bs)
            mine.update(bs)
        if mine:  # a pin of no whole block holds nothing of its owner's budget
            self._by_owner[owner] = mine
        pin = Pin(new_pin_id(), num_blocks * m.block_size, blocks, cache_salt=seq.cache_salt,
                  owner=owner)
        self._pins[pin.id] = pin
        return pin

    def unpin(self, pin_id: str, owner: str | None = None) -> Pin | None:
        """Let a pin go (its blocks stay cached, idle); None if there is no such pin, or it is
        not `owner`'s (None: whoever made it)."""
        pin = self._pins.get(pin_id)
        if pin is None or (owner is not None and pin.owner != owner):
            return None
        del self._pins[pin_id]
        mine = self._by_owner.get(pin.owner, Counter())  # none for a pin of no whole block
        for g, bs in zip(self.manager.groups, pin.blocks):
            self._count.subtract(bs)
            mine.subtract(bs)
            g.index.mark_idle(self.manager.pool.release(bs))
        self._count = +self._count
        mine = +mine
        if mine:
            self._by_owner[pin.owner] = mine
        else:
            self._by_owner.pop(pin.owner, None)
        return pin

    def list(self, owner: str | None = None) -> list[Pin]:
        """The pins, or `owner`'s only."""
        return [p for p in self._pins.values() if owner is None or p.owner == owner]

    def summary(self, owner: str | None = None) -> dict[str, Any]:
        """`GET /v1/cache/pins`: `owner`'s pins and its own count and budget, or (None: the
        admin) every pin and the server-wide count and cap; never another tenant's count."""
        pinned = self.num_pinned_blocks if owner is None else self.owner_blocks(owner)
        limit = self.total_limit_blocks if owner is None else self.limit_blocks
        return {"object": "list", "data": [p.as_dict() for p in self.list(owner)],
                "num_pinned_blocks": pinned, "limit_blocks": limit,
                "max_pinned_fraction": self.max_fraction,
                "max_pinned_total_fraction": self.max_total_fraction}

    def clear(self) -> None:
        for pin_id in list(self._pins):
            self.unpin(pin_id)

    def holders(self) -> Sequence[list[int]]:
        """Every pin's blocks, as block-table-like holders (the manager's invariants)."""
        return [bs for pin in self._pins.values() for bs in pin.blocks]
