"""The replica's side of KV events: numbered, kept for a while, served by long poll.

The engine records which blocks entered and left its prefix index (kv/events.py) and drains
them into the `EngineStats` snapshot it hands its stat loggers after every step (and when it
goes idle, which catches a prefix-cache reset); this stat logger numbers them and keeps the
last `capacity` in a ring. A gateway (kvserve/router/events.py) asks
`GET /v1/kv_events?since=SEQ&timeout=S` and gets every event after SEQ, waiting up to S
seconds when there is none yet.

An answer carries the server's `epoch` (new at every start) and `lost`: true when events after
SEQ are no longer kept (the ring wrapped, or the engine dropped some before they were drained),
so the subscriber must forget what it believed of this replica and start over.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.stats import EngineStats

MAX_EVENTS_PER_ANSWER = 10_000


@dataclass(frozen=True, slots=True)
class NumberedEvent:
    seq: int
    kind: str
    block_hash: int
    parent_hash: int

    def as_json(self) -> dict[str, Any]:
        """vLLM's event shape: one block per event here."""
        if self.kind == "AllBlocksCleared":
            return {"seq": self.seq, "type": self.kind}
        return {"seq": self.seq, "type": self.kind, "block_hashes": [self.block_hash],
                "parent_block_hash": self.parent_hash}


class KVEventPublisher:
    """A `StatLogger` (engine/async_engine.py) that publishes the engine's KV events."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.epoch = uuid.uuid4().hex
        self._ring: deque[NumberedEvent] = deque(maxlen=capacity)
        self._next_seq = 0
        self._lost_before = 0  # events with seq < this may be missing (dropped by the engine)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    # -- the engine's loop thread -----------------------------------------------------------
    def on_step(self, stats: EngineStats, outputs: Sequence, streaming, now: float) -> None:
        self._take(stats.kv_events, stats.kv_events_dropped)

    def on_idle(self, stats: EngineStats) -> None:
        self._take(stats.kv_events, stats.kv_events_dropped)

    def on_request_gone(self, request_id: str) -> None:
        pass

    def _take(self, events: Sequence, dropped: int) -> None:
        """Number the events drained since the last snapshot; `dropped` of them were lost
        before the drain."""
        if not events and not dropped:
            return
        with self._lock:
            if dropped:
                self._next_seq += dropped  # the gap is visible to anyone who asks across it
                self._lost_before = self._next_seq
            for ev in events:
                self._ring.append(NumberedEvent(self._next_seq, ev.kind, ev.block_hash,
                                                ev.parent_hash))
                self._next_seq += 1
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the event loop closed under us (shutdown)
                pass

    # -- the event loop ---------------------------------------------------------------------
    def _answer(self, since: int) -> dict[str, Any] | None:
        with self._lock:
            first = self._ring[0].seq if self._ring else self._next_seq
            lost = since + 1 < max(first, self._lost_before) and since + 1 < self._next_seq
            events = [e for e in self._ring if e.seq > since][:MAX_EVENTS_PER_ANSWER] \
                if self._next_seq > since + 1 else []
            if not events and not lost:
                return None
            last = events[-1].seq if events else self._next_seq - 1
        return {"epoch": self.epoch, "lost": lost, "last_seq": last,
                "events": [e.as_json() for e in events]}

    async def poll(self, since: int, timeout: float) -> dict[str, Any]:
        """Events after `since`, waiting up to `timeout` seconds for the first one."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
        assert self._changed is not None
        deadline = self._loop.time() + max(0.0, timeout)
        while True:
            self._changed.clear()
            answer = self._answer(since)
            if answer is not None:
                return answer
            left = deadline - self._loop.time()
            if left <= 0:
                return {"epoch": self.epoch, "lost": False, "last_seq": since, "events": []}
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
