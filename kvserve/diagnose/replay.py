"""The hit rate of a log, measured by replaying its rendered prompts through kvserve's
simulator (`kvserve.sim.replay`), which drives the engine's own `KVCacheManager`.

Why the simulator and not a prefix count: what a fix is worth depends on the pool. With a pool
that cannot hold every distinct prefix, a fix that makes prompts share more also keeps more
blocks alive; the simulator evicts as the engine does (LRU, whole blocks, the last prompt token
always computed, the cache salt in every block's key), so its hit rate is the one the server
would report for the same requests sent one after another (`lifetime="immediate"`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.diagnose.render import Rendered
from kvserve.sim.replay import SimConfig, replay
from kvserve.sim.trace import Trace, TraceRequest

DEFAULT_BLOCK_SIZE = 16


@dataclass
class PoolSize:
    block_size: int
    pool_blocks: int
    source: str  # "request log", "flags" or "unbounded" (what the numbers came from)
    policy: str = "lru"  # the server's eviction policy (the request log's header)


@dataclass
class HitRate:
    hit_tokens: int
    prompt_tokens: int

    @property
    def rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def unbounded_pool(rendered: list[Rendered], block_size: int) -> int:
    """Blocks enough for every prompt at once: no eviction (when the server's pool is not
    known, the hit rate a cache could reach)."""
    return sum(-(-len(r.token_ids) // block_size) for r in rendered) + 1


def to_trace(rendered: list[Rendered]) -> Trace:
    """Prompts as a trace, in log order, each generating one token (what a logged request's
    prefill is; its output never reaches another request's prompt)."""
    reqs = [TraceRequest(len(r.token_ids), 1, None, list(r.token_ids), None, None,
                         r.cache_salt) for r in rendered]
    return Trace(reqs, source="request log")


def hit_rate(rendered: list[Rendered], pool: PoolSize, resets: list[int] = ()) -> HitRate:
    """Cached prompt tokens / prompt tokens over the log, replayed in order, from an empty
    cache at the start and at each reset (the number of requests before it)."""
    cfg = SimConfig(capacity_tokens=pool.pool_blocks * pool.block_size,
                    block_size=pool.block_size, policy=pool.policy, lifetime="immediate")
    bounds = [0, *sorted(b for b in resets if 0 < b < len(rendered)), len(rendered)]
    hits = 0
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            continue
        got = replay(to_trace(rendered[lo:hi]), cfg)
        if got["rejected"]:
            raise ValueError(f"{got['rejected']} requests do not fit a pool of "
                             f"{pool.pool_blocks} blocks of {pool.block_size} tokens")
        hits += got["hit_tokens"]
    return HitRate(hits, sum(len(r.token_ids) for r in rendered))
