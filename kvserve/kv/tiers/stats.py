"""Counters of the storage tiers, shared by the engine thread and the background workers."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

SOURCES = ("device", "host", "disk", "remote", "peer")  # where a cached token's KV came from


@dataclass
class TierStats:
    bytes_saved: Counter = field(default_factory=Counter)  # by tier
    bytes_loaded: Counter = field(default_factory=Counter)  # by tier
    errors: Counter = field(default_factory=Counter)  # by (tier, kind)
    skipped_saves: Counter = field(default_factory=Counter)  # by reason
    load_latencies: deque = field(default_factory=lambda: deque(maxlen=4096))  # (tier, seconds)
    num_load_latencies: int = 0  # every latency ever observed, for exporters that poll
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, counter: str, key, amount: int = 1) -> None:
        with self._lock:
            getattr(self, counter)[key] += amount

    def observe_load(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.load_latencies.append((tier, seconds))
            self.num_load_latencies += 1

    def latencies_since(self, count: int) -> tuple[list[tuple[str, float]], int]:
        """Latencies observed after the first `count` (those still kept), and the new count."""
        with self._lock:
            new = self.num_load_latencies - count
            kept = list(self.load_latencies)[-new:] if new > 0 else []
            return kept, self.num_load_latencies

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {"bytes_saved": dict(self.bytes_saved),
                    "bytes_loaded": dict(self.bytes_loaded),
                    "errors": {f"{t}:{k}": n for (t, k), n in self.errors.items()},
                    "skipped_saves": dict(self.skipped_saves)}
