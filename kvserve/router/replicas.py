"""One replica as the gateway knows it, and the health checker that takes failed replicas out
of the rotation and puts them back.

A replica is out (`healthy` false) from the first failed health check or connection, and back
at the first successful health check; coming back, its prefix picture is emptied (it may have
restarted with an empty cache; its KV events will fill the picture again).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvserve.router.metrics import RouterMetrics
from kvserve.router.prefix_view import PrefixView

logger = logging.getLogger("kvserve.router")


class ReplicaState:
    """A `kvserve serve` process behind the gateway: what the routing policies see of it
    (`available`, `load`, `match_tokens`) and what the gateway counts."""

    def __init__(self, index: int, url: str, block_size: int,
                 view_capacity_blocks: int = 1_000_000, name: str | None = None) -> None:
        self.index = index  # its place in its pool (what a policy's choice names)
        self.url = url.rstrip("/")
        # its label in metrics, logs and x-kvserve-replica: the index, or e.g. "prefill0" when
        # the gateway has several pools (PD disaggregation), whose indices overlap
        self.name = name if name is not None else str(index)
        self.block_size = block_size
        self.view = PrefixView(view_capacity_blocks)
        self.healthy = False  # until the first health check passes
        self.in_flight = 0

    # -- what a policy sees (kvserve/router/policies.py ReplicaView) -------------------------
    @property
    def available(self) -> bool:
        return self.healthy

    @property
    def load(self) -> int:
        return self.in_flight

    def match_tokens(self, request) -> int:
        return self.view.match_blocks(request.block_hashes) * self.block_size

    @property
    def cached_blocks(self) -> int:
        return len(self.view)

    # -- health -----------------------------------------------------------------------------
    def mark_failed(self, why: str) -> None:
        if self.healthy:
            logger.warning("replica %s (%s) is out: %s", self.name, self.url, why)
        self.healthy = False

    def mark_healthy(self) -> None:
        if not self.healthy:
            logger.info("replica %s (%s) is in", self.name, self.url)
            self.view.clear()
        self.healthy = True


async def check_once(client: httpx.AsyncClient, replica: ReplicaState, timeout: float) -> bool:
    """GET /health: 200 puts the replica in, anything else (or no answer) takes it out."""
    try:
        r = await client.get(f"{replica.url}/health", timeout=timeout)
        ok = r.status_code == 200
        why = f"/health answered {r.status_code}"
    except httpx.HTTPError as exc:
        ok, why = False, f"/health failed: {type(exc).__name__}"
    if ok:
        replica.mark_healthy()
    else:
        replica.mark_failed(why)
    return ok


async def health_loop(client: httpx.AsyncClient, replicas: list[ReplicaState],
                      metrics: RouterMetrics, interval: float, timeout: float) -> None:
    """Check every replica every `interval` seconds, all at once, until cancelled."""
    while True:
        await asyncio.gather(*(check_once(client, r, timeout) for r in replicas))
        for r in replicas:
            metrics.child(metrics.healthy, replica=r.name).set(1 if r.healthy else 0)
        await asyncio.sleep(interval)
