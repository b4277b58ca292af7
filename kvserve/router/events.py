"""The gateway's side of KV events: one long-poll loop per replica on its /v1/kv_events
(kvserve/server/kv_events.py), applied to that replica's prefix picture.

BlockStored adds a block, BlockRemoved takes it out, AllBlocksCleared empties the picture; so
does an answer flagged `lost` (events after our last one are gone) or a new `epoch` (the replica
restarted). A replica without the endpoint (404), or one that refuses the gateway's credential
(the events are its admin's: `kvserve route --admin-api-key`), is left to routing history alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from kvserve.router.metrics import RouterMetrics
from kvserve.router.replicas import ReplicaState

logger = logging.getLogger("kvserve.router")

POLL_TIMEOUT_S = 10.0


def apply_events(replica: ReplicaState, answer: dict[str, Any], metrics: RouterMetrics) -> None:
    view = replica.view
    if answer.get("lost"):
        view.clear()
    for ev in answer.get("events", ()):
        kind = ev.get("type")
        if kind == "BlockStored":
            view.add(ev.get("block_hashes", ()))
        elif kind == "BlockRemoved":
            view.remove(ev.get("block_hashes", ()))
        elif kind == "AllBlocksCleared":
            view.clear()
        known = kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        metrics.child(metrics.kv_events, replica=replica.name,
                      type=kind if known else "other").inc()


async def subscribe(client: httpx.AsyncClient, replica: ReplicaState, metrics: RouterMetrics,
                    headers: dict[str, str], retry_s: float = 1.0) -> None:
    """Follow one replica's KV events until cancelled."""
    since, epoch = -1, None
    while True:
        if not replica.healthy:
            await asyncio.sleep(retry_s)
            continue
        try:
            r = await client.get(f"{replica.url}/v1/kv_events",
                                 params={"since": since, "timeout": POLL_TIMEOUT_S},
                                 headers=headers, timeout=POLL_TIMEOUT_S + 5)
        except httpx.HTTPError:
            await asyncio.sleep(retry_s)
            continue
        if r.status_code == 404:
            logger.warning("replica %s has no /v1/kv_events: routing history only", replica.name)
            return
        if r.status_code in (401, 403):  # the events are the replica admin's to read
            logger.warning("replica %s refuses its /v1/kv_events (%d): give kvserve route the "
                           "replicas' --admin-api-key; routing history only", replica.name,
                           r.status_code)
            return
        if r.status_code != 200:
            await asyncio.sleep(retry_s)
            continue
        answer = r.json()
        if answer.get("epoch") != epoch:
            if epoch is not None:  # restarted: what we knew is gone, and its numbering too
                replica.view.clear()
                if since >= 0:
                    since = -1
                    epoch = answer.get("epoch")
                    continue
            epoch = answer.get("epoch")
        apply_events(replica, answer, metrics)
        since = int(answer.get("last_seq", since))
