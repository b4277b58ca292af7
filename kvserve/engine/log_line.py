"""The AsyncLLMEngine's periodic log line: throughput, queues, KV usage and the prefix-cache hit
rate of the last interval (vLLM's wording), on the "kvserve" logger.

Why apart from the loop: it is a reader of figures (token counts from the outputs, and one
`EngineStats` snapshot per interval), not part of how requests are driven; kept here, the
loop's file holds only the loop. Everything runs on the engine loop's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestOutput

logger = logging.getLogger("kvserve")


@dataclass
class _IntervalStats:
    """What the periodic log line reports, accumulated on the loop thread."""

    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    active: bool = False


class ThroughputLog:
    """Counts the tokens the outputs show and writes one line per `interval` seconds of work
    (an interval opens with the first work after an idle spell)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._now = _IntervalStats()
        self._prompt_lens: dict[str, int] = {}  # prompt tokens of requests already counted
        self._gen_counts: dict[str, int] = {}  # generated tokens counted so far per request
        self._last_cache = (0, 0)  # prefix-cache queries and hits at the last line

    def __len__(self) -> int:
        """Requests tracked (none when idle: the memory diagnostics check that)."""
        return len(self._prompt_lens) + len(self._gen_counts)

    def count(self, outputs: Sequence[RequestOutput]) -> None:
        iv = self._now
        if not iv.active:  # the first work after an idle spell opens the interval
            iv.start = time.monotonic()
            iv.active = True
        for out in outputs:
            rid = out.request_id
            if rid not in self._prompt_lens and rid not in self._gen_counts:
                iv.prompt_tokens += len(out.prompt_token_ids)
                self._prompt_lens[rid] = len(out.prompt_token_ids)
            total = sum(len(c.token_ids) for c in out.outputs)
            iv.generation_tokens += total - self._gen_counts.get(rid, 0)
            self._gen_counts[rid] = total

    def forget(self, request_id: str) -> None:
        self._prompt_lens.pop(request_id, None)
        self._gen_counts.pop(request_id, None)

    def due(self) -> bool:
        """Whether an interval of work has passed (a line is to be written)."""
        iv = self._now
        return iv.active and time.monotonic() - iv.start >= self.interval

    def seconds_left(self) -> float | None:
        """How long an idle loop may sleep before the line is due (None: no open interval)."""
        if not self._now.active:
            return None
        return max(0.0, self._now.start + self.interval - time.monotonic()) + 0.01

    def write(self, stats: EngineStats, busy: bool) -> None:
        """The line for the interval that ends now; the next opens at once if `busy`."""
        iv = self._now
        now = time.monotonic()
        elapsed = now - iv.start
        q, h = stats.prefix_cache_queries, stats.prefix_cache_hits
        dq, dh = max(0, q - self._last_cache[0]), max(0, h - self._last_cache[1])
        self._last_cache = (q, h)
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", iv.prompt_tokens / elapsed,
                    iv.generation_tokens / elapsed, stats.num_running, stats.num_waiting,
                    100.0 * stats.kv_cache_usage, 100.0 * dh / dq if dq else 0.0)
        self._now = _IntervalStats(start=now, active=busy)
