"""The engine's side of prefill/decode disaggregation (kv/tiers/transfer.py).

A producer serves its host tier's chunks to consumers (kv/tiers/peer.py's `PeerServer`, the
`kvserve` connector) and answers a `do_remote_decode` request with the `kv_transfer_params` a
consumer needs; a consumer turns a request's `kv_transfer_params` into the producer it
prefetches the prompt's chunks from, which must be one of the producers its configuration
lists. Requests are checked here when they are added, so a request that asks for a transfer
this instance cannot do, or names a producer it does not know, is a clear ValueError, queued
nowhere and dialling nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from kvserve.kv.tiers.peer import PeerServer
from kvserve.kv.tiers.transfer import KVTransferConfig
from kvserve.sampling import SamplingParams

logger = logging.getLogger("kvserve")


class KVTransfer:
    def __init__(self, config: KVTransferConfig | None, tiers) -> None:
        """`tiers`: the engine's TieredKVStore (every transfer config makes one)."""
        self.config = config
        self.tiers = tiers
        self.server: PeerServer | None = None
        if config is not None and config.serves_peers:
            self.server = PeerServer(tiers.host, config.kv_ip, config.kv_port, tiers.auth_key)
            config.kv_port = self.server.address[1]  # kv_port 0: the port the system chose

    def peer_for(self, params: SamplingParams) -> str | None:
        """The producer (host:port) a request pulls its prompt's KV from, if any: always one of
        the configured producers (kv/tiers/producers.py), never an address the caller made up.
        ValueError (a 400) for a transfer this instance cannot do, before any connection."""
        asked = params.kv_transfer_params
        if not asked:
            return None
        role = self.config.kv_role if self.config is not None else None
        if asked.get("do_remote_decode") and (role is None or not self.config.is_producer):
            raise ValueError("kv_transfer_params.do_remote_decode needs an instance started "
                             "with kv_transfer_config kv_role kv_producer or kv_both "
                             f"(this one: {role or 'no kv_transfer_config'})")
        if not asked.get("do_remote_prefill"):
            return None
        if role is None or not self.config.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill needs an instance started "
                             "with kv_transfer_config kv_role kv_consumer or kv_both "
                             f"(this one: {role or 'no kv_transfer_config'})")
        connector = asked.get("kv_connector", "kvserve")
        if connector != self.config.kv_connector:
            raise ValueError(f"kv_transfer_params come from a {connector!r} connector; this "
                             f"instance uses {self.config.kv_connector!r}")
        return self.config.peer_address(asked)

    def answer(self, params: SamplingParams) -> dict[str, Any] | None:
        """A producer's `kv_transfer_params` for a finished `do_remote_decode` request: its
        chunks are in host memory already (write-through); with the Redis connector, the queued
        saves are written first, so that the consumer finds them."""
        asked = params.kv_transfer_params
        if not asked or not asked.get("do_remote_decode") or self.config is None:
            return None
        if self.config.kv_connector == "redis" and not self.tiers.flush(
                timeout=self.tiers.config.prefetch_timeout):
            logger.warning("KV transfer: Redis saves still queued; the consumer recomputes "
                           "what it does not find")
        return self.config.producer_params()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
