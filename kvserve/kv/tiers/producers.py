"""Which producers a KV consumer may pull from: the operator's list, never a caller's address.

A request's `kv_transfer_params` used to name any `remote_host`/`remote_port`, and the consumer
connected there: a port scanner of the server's network for anyone with an API key, and a way to
feed it KV. Now a consumer's `kv_transfer_config` lists its producers
(`kv_connector_extra_config.producers`: "host:port" strings or
`{"engine_id": ..., "host": ..., "port": ...}` objects), and a request may only *name* one of
them: by `remote_engine_id` (an entry that has one), or by the exact configured host and port
(what a producer's own answer carries, so the gateway's two hops work unchanged). Anything else
is a ValueError (a 400) raised before any name is resolved or any socket opened; the address
dialled is always the configured one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ENTRY_KEYS = ("engine_id", "host", "port")
_WHERE = "kv_connector_extra_config.producers"


@dataclass(frozen=True)
class Producer:
    host: str
    port: int
    engine_id: str | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"{host}:{self.port}"

    def is_at(self, host: str, port: int) -> bool:
        """The exact configured address (host names compared without case, never resolved)."""
        return port == self.port and host.strip("[]").lower() == self.host.lower()


def parse_producers(value: Any) -> tuple[Producer, ...]:
    """The configured producers, checked at start-up with errors that say what to write."""
    if not isinstance(value, list):
        raise ValueError(f"{_WHERE} must be a list of \"host:port\" strings or "
                         f"{{\"engine_id\", \"host\", \"port\"}} objects, got {value!r}")
    return tuple(_parse_entry(i, entry) for i, entry in enumerate(value))


def _parse_entry(i: int, entry: Any) -> Producer:
    where = f"{_WHERE}[{i}]"
    if isinstance(entry, str):
        host, sep, port = entry.rpartition(":")
        entry = {"host": host, "port": int(port) if port.isdigit() else port} if sep else {}
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be \"host:port\" or an object, got {entry!r}")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(_ENTRY_KEYS)}")
    host, port, engine_id = entry.get("host"), entry.get("port"), entry.get("engine_id")
    if not isinstance(host, str) or not host.strip("[]"):
        raise ValueError(f"{where} needs a host (\"host:port\", or a \"host\" key)")
    if not _is_port(port):
        raise ValueError(f"{where} needs a port number 1..65535, got {port!r}")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise ValueError(f"{where}: engine_id must be a non-empty string, got {engine_id!r}")
    return Producer(host.strip("[]"), port, engine_id)


def _is_port(port: Any) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


def resolve_producer(producers: tuple[Producer, ...], params: dict[str, Any]) -> Producer:
    """The configured producer a request's `kv_transfer_params` names; ValueError otherwise.
    Pure: nothing is resolved or dialled here, whatever the request says."""
    host, port = params.get("remote_host"), params.get("remote_port")
    engine_id = params.get("remote_engine_id")
    if host is not None or port is not None:
        if not isinstance(host, str) or not host or not _is_port(port):
            raise ValueError("kv_transfer_params with do_remote_prefill need remote_host (a "
                             "string) and remote_port (a port number)")
    if not producers:
        raise ValueError("this KV consumer has no configured producers, so it pulls from "
                         "none: list them in its kv_transfer_config as "
                         f"{_WHERE} ([\"host:port\", ...])")
    if isinstance(engine_id, str):
        for producer in producers:
            if producer.engine_id is not None and producer.engine_id == engine_id:
                return producer
    if host is not None:
        for producer in producers:
            if producer.is_at(host, port):
                return producer
    raise ValueError("kv_transfer_params name no producer this KV consumer is configured to "
                     f"pull from (remote_engine_id, or remote_host and remote_port exactly as "
                     f"in its {_WHERE})")
