"""`kv_transfer_config`: prefill/decode disaggregation, as storage tiers between instances.

vLLM's flag and JSON keys: `kv_connector` (`kvserve`: the consumer pulls chunks straight from
the producer over TCP, kv/tiers/peer.py; `redis`: both sides share a Redis tier), `kv_role`
(`kv_producer` runs prefills and keeps their KV for a consumer, `kv_consumer` decodes requests
whose prompt a producer computed, `kv_both` either), `kv_ip` / `kv_port` (where a producer
serves its chunks, and what it tells consumers), `kv_buffer_size` (bytes of host memory for the
chunks in flight), `engine_id`, and `kv_connector_extra_config` (`redis_url`, `chunk_size`,
`transfer_timeout`, `producers`: whom a consumer pulls from, producers.py; `auth_key_file`: the
secret chunks are authenticated with, auth.py).

Why tiers: a transfer needs exactly what the tiers already do — read a request's computed
chunks out of the device as they are computed (write-through), frame and checksum them, find a
request's chunks by hash before admitting it, wait for them in the background with a deadline,
and recompute whatever did not arrive whole. So the config is turned into a tier config
(`tier_config`), and a request that carries a producer's `kv_transfer_params` prefetches from
that producer (`peer_address`), if it is one of the consumer's configured producers. The prefix
cache works on both sides as always.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvserve.kv.tiers.config import GB, TierConfig, check_keys
from kvserve.kv.tiers.producers import Producer, parse_producers, resolve_producer
from kvserve.utils.validation import json_object

CONNECTORS = ("kvserve", "redis")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
EXTRA_KEYS = ("redis_url", "chunk_size", "transfer_timeout", "producers", "auth_key_file")


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # bytes of host memory for transferred chunks (vLLM's default)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector must be one of {CONNECTORS}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {ROLES}, "
                             f"got {self.kv_role!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) \
                or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config kv_port must be a port number, "
                             f"got {self.kv_port!r}")
        if not isinstance(self.kv_buffer_size, (int, float)) or self.kv_buffer_size <= 0:
            raise ValueError(f"kv_transfer_config kv_buffer_size must be a number of bytes > 0, "
                             f"got {self.kv_buffer_size!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; known: "
                             f"{list(EXTRA_KEYS)}")
        if self.kv_connector == "redis" and not extra.get("redis_url"):
            raise ValueError("kv_connector 'redis' needs kv_connector_extra_config.redis_url "
                             "(redis://host:port/db, the same on producer and consumer)")
        if "producers" in extra and (self.kv_connector != "kvserve" or not self.is_consumer):
            raise ValueError("kv_connector_extra_config.producers is for a kv_consumer or "
                             "kv_both of the 'kvserve' connector (whom it pulls from); this "
                             f"one is a {self.kv_role} of {self.kv_connector!r}")
        self.producers  # parsed once, here: a malformed list is refused at start-up
        if "auth_key_file" in extra:
            TierConfig(auth_key_file=extra["auth_key_file"])  # unreadable or short: refused

    @cached_property
    def producers(self) -> tuple[Producer, ...]:
        """The producers a consumer may pull from (producers.py); none configured: none."""
        return parse_producers(self.kv_connector_extra_config.get("producers", []))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def serves_peers(self) -> bool:
        """A producer of the direct connector listens for consumers' pulls."""
        return self.kv_connector == "kvserve" and self.is_producer

    def tier_config(self, base: TierConfig | None, block_size: int) -> TierConfig:
        """The tiers this role needs, on top of `kv_tier_config` when one is given: host memory
        for the chunks in flight, write-through on a producer (each chunk saved as soon as it is
        computed, so it is there when the prefill's answer goes out), Redis for that
        connector, and the transfer timeout as the prefetch deadline."""
        extra = self.kv_connector_extra_config
        # One block per chunk by default: all of a prompt's whole blocks travel (vLLM's
        # connectors move blocks); only the partial last one is computed again.
        chunk = int(extra.get("chunk_size", base.chunk_size if base else block_size))
        cfg = base or TierConfig(chunk_size=chunk, max_local_cpu_size=self.kv_buffer_size / GB)
        changes: dict[str, Any] = {"chunk_size": chunk, "local_cpu": True}
        if not base or not base.local_cpu:
            changes["max_local_cpu_size"] = self.kv_buffer_size / GB
        if self.is_producer:
            changes["write_policy"] = "write_through"
        if self.kv_connector == "redis":
            changes["remote_url"] = extra["redis_url"]
        if "transfer_timeout" in extra:
            changes["prefetch_timeout"] = float(extra["transfer_timeout"])
        if "auth_key_file" in extra:
            changes["auth_key_file"] = extra["auth_key_file"]
        return dataclasses.replace(cfg, **changes)

    def peer_address(self, params: dict[str, Any] | None) -> str | None:
        """The configured producer (host:port) a consumer's request pulls from, from the
        `kv_transfer_params` it carries; None when it asks for no pull (no remote prefill, or
        the shared Redis tier has the chunks). A producer that is not configured, or a
        malformed request, is a ValueError, raised before any connection."""
        if not params or not params.get("do_remote_prefill") \
                or params.get("kv_connector") == "redis":
            return None
        return resolve_producer(self.producers, params).address

    def producer_params(self) -> dict[str, Any]:
        """What a producer's answer to a `do_remote_decode` request carries (vLLM's
        `kv_transfer_params`): enough for a consumer to pull the prompt's KV."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.kv_ip,
                "remote_port": self.kv_port, "remote_block_ids": None, "tp_size": 1,
                "kv_connector": self.kv_connector}


def load_transfer_config(source: "str | dict[str, Any] | KVTransferConfig | None"
                         ) -> KVTransferConfig | None:
    """From JSON (vLLM's `--kv-transfer-config '{...}'`), a dict, or itself (None stays)."""
    if source is None or isinstance(source, KVTransferConfig):
        return source
    source = json_object(source, "kv_transfer_config")
    check_keys(KVTransferConfig, source, "kv_transfer_config")
    missing = [k for k in ("kv_connector", "kv_role") if k not in source]
    if missing:
        raise ValueError(f"kv_transfer_config needs {missing}")
    return KVTransferConfig(**source)
