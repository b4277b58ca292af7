"""Which grammar compile runs next: round-robin across tenants, each tenant's own in order.

Why: compiles are CPU-bound and a hostile schema can take minutes (xgrammar's JSON-schema
grammars grow with the cube of a schema's optional properties), so the order they start in is
what decides whether one caller's schema holds everybody else's structured outputs (issue 63).
A tenant (an API key, or a cache namespace without keys) never runs more than `per_tenant`
compiles at once, and the tenants with work take turns; a tenant that sends a thousand schemas
waits behind its own, not in front of anyone else's.

The queue holds opaque items and knows nothing of grammars or processes, so the rules are
tested alone (tests/test_grammar_compile.py). It is not thread-safe: its one user
(`kvserve.structured.compiler.GrammarCompiler`) holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, Hashable, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Per-tenant FIFO queues served round-robin, with a bound on each tenant's running items."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be >= 1, got {per_tenant}")
        self.per_tenant = per_tenant
        # Tenants with queued items, in the order of their next turn (served: to the back).
        self._queued: OrderedDict[Hashable, deque[T]] = OrderedDict()
        self._running: dict[Hashable, int] = {}
        self._tenant_of: dict[int, Hashable] = {}  # id(item) -> its tenant, queued or running

    def push(self, tenant: Hashable, item: T) -> None:
        self._queued.setdefault(tenant, deque()).append(item)
        self._tenant_of[id(item)] = tenant

    def pop(self) -> T | None:
        """The next item to start (now counted as running), or None if every tenant with queued
        items already runs as many as it may."""
        for tenant, items in self._queued.items():
            if self._running.get(tenant, 0) < self.per_tenant:
                item = items.popleft()
                if items:
                    self._queued.move_to_end(tenant)
                else:
                    del self._queued[tenant]
                self._running[tenant] = self._running.get(tenant, 0) + 1
                return item
        return None

    def remove(self, item: T) -> bool:
        """Drop a queued item (its callers left); False if it is not queued."""
        tenant = self._tenant_of.get(id(item))
        items = self._queued.get(tenant) if tenant is not None else None
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._queued[tenant]
        del self._tenant_of[id(item)]
        return True

    def finish(self, item: T) -> None:
        """A running item ended (done, failed or killed): its tenant may start another."""
        tenant = self._tenant_of.pop(id(item))
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]

    def __len__(self) -> int:
        """Items queued (not running)."""
        return sum(len(items) for items in self._queued.values())

    def running(self, tenant: Hashable) -> int:
        return self._running.get(tenant, 0)
