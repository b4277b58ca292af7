"""`EngineStats`: one reading of the engine's gauges and cumulative counters.

The periodic log line of the AsyncLLMEngine and its stat loggers (the Prometheus exporter,
kvserve.server.metrics; the KV-event publisher, kvserve.server.kv_events) all read this
snapshot, taken by `LLMEngine.stats()`, instead of each reaching into the scheduler, the KV
manager and the tiers on its own: one place knows where a figure lives, so the reports cannot
disagree about what "running" or "a prefix-cache hit" means, and a stat logger needs nothing of
`kvserve.kv` (tests/test_architecture.py checks that it imports none of it).

`LLMEngine.step_stats()` adds what happened since its previous call (tier load latencies, KV
events): the AsyncLLMEngine takes one such snapshot after each step, and when it goes idle, and
hands the same one to every stat logger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, not yet scheduled (or preempted back)
    kv_cache_usage: float  # 0..1 of the KV pool; idle cached prefix blocks count as free
    # Cumulative since the engine started (a prefix-cache reset may restart the cache ones).
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose KV was found (any tier)
    num_evicted_blocks: int  # cached blocks evicted from the device pool
    # Prefix-cache hit tokens by where the KV came from: device, host, disk, remote.
    hit_tokens: dict[str, int] = field(default_factory=dict)
    # Prompt tokens not served from the cache, by the cache report's reason (kv/report.py):
    # counted for the requests that asked for a report (the reason is decided only for them).
    missed_tokens: dict[str, int] = field(default_factory=dict)
    num_pins: int = 0  # prefixes pinned (kv/pins.py)
    num_pinned_blocks: int = 0
    # Idle cached blocks per tenant (0 for one that has none now), with tenant quotas on
    # (kv/block_pool.py); else empty.
    idle_blocks_by_tenant: dict[str, int] = field(default_factory=dict)
    # Hit audits (engine/audit.py): audited_hits, audited_blocks, mismatches, dropped_blocks,
    # skipped; empty when audits are off.
    audits: dict[str, int] = field(default_factory=dict)
    # Swap preemption (kv/swap.py): swapped_out, swapped_in, bytes_out, bytes_in, and
    # fallback_<reason> (recomputed instead); empty when every preemption recomputes.
    swap: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (kvserve/spec/speculator.py's SpecCounters, vLLM's names):
    # num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos; empty without it.
    spec_decode: dict = field(default_factory=dict)
    # Document reuse (kvserve/blend/): its counters, audits and whether it is on ({}: off).
    blend: dict = field(default_factory=dict)
    # Fixed once the engine is built: block size, device pool blocks, KV cache dtype.
    block_size: int = 0
    num_gpu_blocks: int = 0
    cache_dtype: str = ""
    # Storage tiers: bytes_saved, bytes_loaded, errors, skipped_saves (kv/tiers/stats.py's
    # snapshot) and the bytes each tier holds; empty without tiers.
    tier_stats: dict[str, dict] = field(default_factory=dict)
    tier_usage: dict[str, int] = field(default_factory=dict)
    # Since the previous `step_stats()` only (empty from `stats()`): tier load latencies
    # (tier, seconds), the prefix index's events (kv/events.py's KVEvent records) and how many
    # events were dropped for want of room before they were drained.
    tier_load_latencies: tuple[tuple[str, float], ...] = ()
    kv_events: tuple[Any, ...] = ()
    kv_events_dropped: int = 0
