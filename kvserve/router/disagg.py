"""Prefill/decode disaggregation at the gateway (`kvserve route --prefill URL --decode URL`),
the way vLLM's disagg proxy and SGLang's PD router do it: two hops per request.

1. A prefill instance, chosen by the gateway's policy (cache-aware by default, over the prefill
   instances only: they hold the prefixes, and their KV events keep the gateway's picture),
   gets the request cut down to its prompt: one token, no stream, and
   `kv_transfer_params: {"do_remote_decode": true}`. It computes the prompt's KV and answers a
   normal completion carrying a top-level `kv_transfer_params` that says where that KV can be
   fetched. The gateway never looks inside it.
2. A decode instance, the least loaded one, gets the client's own body plus that
   `kv_transfer_params`, pulls the KV instead of recomputing it, and its answer goes to the
   client exactly as a replica's would in the ordinary mode (app.py: retries before the first
   byte, streams relayed with backpressure).

Faults never change an answer, only its cost: if the prefill hop fails (no instance reachable,
a 5xx, a timeout, an answer without `kv_transfer_params`), the gateway logs and counts it and
sends the client's body to a decode instance without `kv_transfer_params`, which then computes
the prompt itself. A 4xx from the prefill instance is the request's own fault, so it goes back
to the client as is, and decode is not tried.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response

from kvserve.router.app import Gateway, Keyed, Pool, RouterConfig, error_body
from kvserve.router.keys import PrefixKeyer
from kvserve.router.policies import LeastLoadedPolicy, RoutingPolicy
from kvserve.router.replicas import ReplicaState

logger = logging.getLogger("kvserve.router")

# What the prefill hop asks for: compute the prompt, keep its KV for a remote decode.
PREFILL_TRANSFER = {"do_remote_decode": True, "do_remote_prefill": False}
# Fields that describe generating more than one token, or streaming it: the prefill hop drops
# them (min_tokens would make its max_tokens of 1 a 400).
_PREFILL_DROPPED = ("max_completion_tokens", "stream_options", "min_tokens")
_SERIALIZE_INLINE_BYTES = 64 * 1024  # larger bodies are re-serialized in a worker thread


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: the same prompt and sampling fields, one
    token, not streamed, its KV kept for the decode instance. `n` stays as the client set it."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_TRANSFER))
    return out


def decode_body(body: dict[str, Any], transfer: dict[str, Any]) -> dict[str, Any]:
    """The client's body with the prefill's answer: where the decode instance fetches the KV."""
    return {**body, "kv_transfer_params": transfer}


def transfer_params(content: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` object of a prefill instance's answer (opaque to the gateway),
    or None when the answer has none (an instance not set up as a KV producer)."""
    try:
        answer = json.loads(content)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


async def _dumps(body: dict[str, Any], size_hint: int) -> bytes:
    """`body` as JSON bytes; off the event loop when large, like the gateway's parsing."""
    def dump() -> bytes:
        return json.dumps(body).encode()

    if size_hint > _SERIALIZE_INLINE_BYTES:
        return await asyncio.to_thread(dump)
    return dump()


@dataclass
class Prefilled:
    """A prefill hop that worked: which instance holds the KV and how to reach it."""

    replica: ReplicaState
    transfer: dict[str, Any]


class DisaggGateway(Gateway):
    """The gateway with a prefill pool (the policy's, `self.pool`) and a decode pool (least
    loaded): `route` runs the two hops; everything else (auth, body limits, keys, health
    checks, retries, relaying) is the ordinary gateway's."""

    def __init__(self, prefill: Sequence[ReplicaState], decode: Sequence[ReplicaState],
                 policy: RoutingPolicy, keyer: PrefixKeyer, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(prefill, policy, keyer, config, transport)
        self.pool.role = "prefill"
        self.decode = Pool("decode", list(decode), LeastLoadedPolicy(), track_prefixes=False)
        self.pools.append(self.decode)
        self.init_gauges(self.decode.replicas)
        for outcome in ("ok", "failed", "rejected"):  # on /metrics at 0 from the start
            self.metrics.child(self.metrics.pd_prefills, outcome=outcome)

    @property
    def model_replicas(self) -> list[ReplicaState]:
        return self.decode.replicas

    async def route(self, path: str, raw: bytes, body: dict[str, Any] | None, keyed: Keyed,
                    headers: dict[str, str]) -> Response:
        """Prefill on one instance, decode on another; decode alone when the prefill fails."""
        if body is None or not any(r.healthy for r in self.decode.replicas):
            # not a JSON object: a decode instance answers why (a 400); no decode instance
            # up: the 503 now, not after a prefill nobody would use
            return self.respond(await self.send(self.decode, keyed, path, raw, headers, False))
        prefilled = await self.prefill(path, raw, body, keyed, headers)
        if isinstance(prefilled, Response):
            return prefilled
        extra: dict[str, str] = {}
        if prefilled is not None:
            raw = await _dumps(decode_body(body, prefilled.transfer), len(raw))
            extra["x-kvserve-prefill"] = prefilled.replica.name
        answer = await self.send(self.decode, keyed, path, raw, headers,
                                 bool(body.get("stream")))
        return self.respond(answer, extra)

    async def prefill(self, path: str, raw: bytes, body: dict[str, Any], keyed: Keyed,
                      headers: dict[str, str]) -> Prefilled | Response | None:
        """The prefill hop: the KV's whereabouts, the prefill's own 4xx for the client, or
        None when it failed (then the decode instance computes the prompt)."""
        data = await _dumps(prefill_body(body), len(raw))
        answer = await self.send(self.pool, keyed, path, data, headers, stream=False,
                                 timeout=self.config.prefill_timeout_s)
        if isinstance(answer, str):
            return self._prefill_failed(answer)
        status = answer.status_code
        if 400 <= status < 500:
            self._count("rejected")
            return self.respond(answer)
        if status != 200:
            return self._prefill_failed(f"{answer.replica.name} answered {status}")
        transfer = transfer_params(answer.content)
        if transfer is None:
            return self._prefill_failed(f"{answer.replica.name} answered without "
                                        "kv_transfer_params (is it a KV producer?)")
        self._count("ok")
        return Prefilled(answer.replica, transfer)

    def _prefill_failed(self, why: str) -> None:
        logger.warning("prefill failed, decoding the whole prompt instead: %s", why)
        self._count("failed")
        return None

    def _count(self, outcome: str) -> None:
        self.metrics.child(self.metrics.pd_prefills, outcome=outcome).inc()

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while a decode instance is up: without prefill instances requests are still
        answered (decoded whole), without decode instances none is."""
        prefill_up = sum(r.healthy for r in self.pool.replicas)
        decode_up = sum(r.healthy for r in self.decode.replicas)
        if not decode_up:
            return 503, error_body(503, "no decode instance is healthy")
        return 200, {"healthy_replicas": prefill_up + decode_up,
                     "replicas": len(self.pool.replicas) + len(self.decode.replicas),
                     "prefill": {"healthy": prefill_up, "replicas": len(self.pool.replicas)},
                     "decode": {"healthy": decode_up, "replicas": len(self.decode.replicas)}}


def disagg_pools(prefill_urls: Sequence[str], decode_urls: Sequence[str], block_size: int
                 ) -> tuple[list[ReplicaState], list[ReplicaState]]:
    """The two pools' replicas, named prefill0.. and decode0.. (their metric labels)."""
    def pool(urls: Sequence[str], role: str) -> list[ReplicaState]:
        return [ReplicaState(i, url, block_size, name=f"{role}{i}")
                for i, url in enumerate(dict.fromkeys(urls))]

    return pool(prefill_urls, "prefill"), pool(decode_urls, "decode")

