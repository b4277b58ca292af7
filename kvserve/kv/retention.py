"""Retention: how long, and how stubbornly, a request's cached prefix stays on the device.

Two request-side spellings map onto one rule:
- Anthropic's `cache_control` breakpoints (`{"type": "ephemeral", "ttl": "5m" | "1h"}` on a
  message or a prompt): the blocks up to the breakpoint are kept ahead of ordinary blocks for
  the TTL (refreshed by every hit, as Anthropic's cache is), and after it they are the first to
  go (`EXPIRED`): an expired breakpoint is a promise that ran out, not an ordinary block.
- TensorRT-LLM's retention config (`kv_retention`: a priority 0..100 for the tokens up to an
  end, for a duration): the blocks keep that priority for the duration, then fall back to the
  default priority (TensorRT-LLM's 35).

The prefix index orders idle blocks by retention priority before the eviction policy's own key
(kv/prefix_index.py), so an LRU/LFU/priority policy is unchanged among blocks of one retention;
with nothing set every block has `DEFAULT_PRIORITY` and eviction is exactly the policy's. A
retention with a TTL is re-keyed lazily, when the index next evicts (`PrefixIndex._expire`): the
order only matters then. Pins (kv/pins.py) are a different thing: a pinned block is held, so no
policy can take it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
MAX_PRIORITY = 100
EXPIRED = 0  # where an expired cache_control breakpoint's blocks go: evicted first
CACHE_CONTROL_PRIORITY = 90  # a live breakpoint: ahead of ordinary blocks, below an explicit 100
CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's two TTLs (5m when none is given)
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class RetentionRange:
    """The blocks holding tokens [0, end) (None: the whole prompt) get `priority` for `ttl`
    seconds (None: for as long as they are cached), then `after`."""

    end: int | None
    priority: int
    ttl: float | None = None
    after: int = DEFAULT_PRIORITY


@dataclass(frozen=True)
class Retention:
    """A request's retention ranges (one per breakpoint); the strongest range covering a block
    decides it."""

    ranges: tuple[RetentionRange, ...]

    def for_block_end(self, end_token: int, prompt_len: int) -> RetentionRange | None:
        """The range a block ending at `end_token` falls under: the highest priority among
        the ranges that reach it, the longest TTL among equals."""
        best: RetentionRange | None = None
        for r in self.ranges:
            if end_token > (prompt_len if r.end is None else r.end):
                continue
            if best is None or (r.priority, r.ttl or math.inf) > (best.priority,
                                                                  best.ttl or math.inf):
                best = r
        return best


def parse_duration(value: Any, what: str) -> float:
    """Seconds from a number of seconds or a string like "5m", "1h", "30s", "250ms"."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be seconds or a duration like \"5m\", got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.strip())):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"{what} must be seconds or a duration like \"5m\", got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive duration, got {value!r}")
    return seconds


def cache_control_range(control: Any, end: int | None) -> RetentionRange:
    """One Anthropic breakpoint: `{"type": "ephemeral", "ttl": "5m" | "1h"}`."""
    if not isinstance(control, Mapping):
        raise ValueError(f"cache_control must be an object, got {control!r}")
    unknown = set(control) - {"type", "ttl"}
    if unknown:
        raise ValueError(f"cache_control has unknown fields: {', '.join(sorted(unknown))}")
    if control.get("type") != "ephemeral":
        raise ValueError(f"cache_control type must be \"ephemeral\", got {control.get('type')!r}")
    ttl = control.get("ttl", "5m")
    if ttl not in CACHE_CONTROL_TTLS:
        raise ValueError(f"cache_control ttl must be \"5m\" or \"1h\", got {ttl!r}")
    return RetentionRange(end, CACHE_CONTROL_PRIORITY, CACHE_CONTROL_TTLS[ttl], EXPIRED)


def kv_retention_range(spec: Any) -> RetentionRange:
    """TensorRT-LLM's retention for one token range from 0: `{"priority": 0..100, "ttl":
    seconds or "10m" (optional), "num_tokens": n (optional; default the whole prompt)}`."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"kv_retention must be an object, got {spec!r}")
    unknown = set(spec) - {"priority", "ttl", "num_tokens"}
    if unknown:
        raise ValueError(f"kv_retention has unknown fields: {', '.join(sorted(unknown))}")
    priority = spec.get("priority", DEFAULT_PRIORITY)
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"kv_retention priority must be an integer in 0..{MAX_PRIORITY}, "
                         f"got {priority!r}")
    ttl = spec.get("ttl")
    seconds = None if ttl is None else parse_duration(ttl, "kv_retention ttl")
    end = spec.get("num_tokens")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < 1):
        raise ValueError(f"kv_retention num_tokens must be a positive integer, got {end!r}")
    return RetentionRange(end, priority, seconds, DEFAULT_PRIORITY)


def make_retention(ranges: Sequence[RetentionRange]) -> Retention | None:
    return Retention(tuple(ranges)) if ranges else None


def retain_sequence(manager: Any, seq: Any, retention: Retention, prompt_len: int) -> None:
    """Give the blocks a sequence has in the prefix index (every group's) its retention: called
    after admission (a hit refreshes a TTL, as a use does) and after its blocks are published."""
    bs = manager.block_size
    for g in manager.groups:
        cursor = g.cursors.get(seq.request_id)
        if cursor is None or not getattr(g.index, "enabled", False):
            continue
        path, node = [], cursor.node
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()  # root first: path[i] holds block i
        now = g.index.clock()
        for i, node in enumerate(path):
            r = retention.for_block_end((i + 1) * bs, prompt_len)
            if r is None:
                break  # every range starts at 0: a block past every end is past them all
            if node.block >= 0:
                g.index.retain(node, r.priority, None if r.ttl is None else now + r.ttl, r.after)
