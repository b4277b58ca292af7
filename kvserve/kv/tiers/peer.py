"""KV chunks pulled straight from another kvserve instance: the `kvserve` KV connector.

Prefill/decode disaggregation (`kv_transfer_config`, kv/tiers/transfer.py) moves one request's
prompt KV from the instance that computed it (the producer) to the one that decodes it (the
consumer). Both sides already have what that needs: the producer writes each chunk into its host
tier as soon as it is computed (write-through), and the consumer's tiers prefetch a request's
chunks in the background before admitting it, check each chunk's framing and checksum
(kv/tiers/chunk.py), and recompute whatever they do not get in time. So the transfer is one more
store below host memory, per request: `PeerStore` asks the producer's `PeerServer` for chunks by
key over TCP, the way the Redis tier asks Redis.

The wire format is deliberately small: the client sends `GET <key>\\n`; the server answers an
8-byte big-endian length and the framed chunk (`encode`), or the length 2**64 - 1 when it does
not hold the chunk. A chunk travels with its own checksum and MAC (chunk.py), so a flipped byte,
or a chunk from anyone but a producer holding the deployment's KV auth key (auth.py), is caught
where the Redis and disk tiers catch it, before it enters host memory, and dropped (the consumer
recomputes it).

Whom a consumer pulls from is the operator's choice, never a caller's: the tiers open a
`PeerStore` only for an address that kv/tiers/producers.py resolved to a configured producer.

Bounds: a key line longer than `MAX_KEY_BYTES` closes the connection; a reply longer than the
consumer's chunk size (plus its header) is refused unread; every socket read and write has a
timeout; the prefetch as a whole has the tiers' `prefetch_timeout`. A producer that dies or
hangs mid-transfer therefore costs the consumer at most that timeout, then a recompute.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading

from kvserve.kv.tiers.chunk import encode
from kvserve.kv.tiers.stats import TierStats

logger = logging.getLogger("kvserve.tiers")

MAX_KEY_BYTES = 1024
_LEN = struct.Struct(">Q")
MISSING = 2**64 - 1
HEADER_SLACK = 4096  # a framed chunk's header, beyond its payload


def parse_address(address: str) -> tuple[str, int]:
    """host:port -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a KV peer address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class PeerServer:
    """The producer's side: answers chunk requests from its host tier, one thread per
    connection (a consumer holds one connection per producer)."""

    def __init__(self, host_store, host: str, port: int, auth_key: bytes,
                 timeout: float = 10.0) -> None:
        store = host_store

        class Handler(socketserver.StreamRequestHandler):
            def setup(self) -> None:
                self.request.settimeout(timeout)
                super().setup()

            def handle(self) -> None:
                while True:
                    try:
                        line = self.rfile.readline(MAX_KEY_BYTES + 1)
                    except OSError:
                        return
                    if not line or not line.endswith(b"\n") or not line.startswith(b"GET "):
                        return  # closed, too long, or not our protocol
                    key = line[4:-1].decode("ascii", "replace")
                    data = store.get(key)
                    blob = encode(key, data, auth_key=auth_key) if data is not None else None
                    try:
                        if blob is None:
                            self.wfile.write(_LEN.pack(MISSING))
                        else:
                            self.wfile.write(_LEN.pack(len(blob)) + blob)
                        self.wfile.flush()
                    except OSError:
                        return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvserve-kv-peer", daemon=True)
        self._thread.start()
        logger.info("KV transfer: serving chunks on %s:%d", *self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PeerStore:
    """The consumer's side: a read-only store over one producer (`Store`'s interface, so the
    tiers' prefetch walks it like disk or Redis). One connection, reopened after an error; the
    tiers' single loader thread is its only caller, the lock makes that a rule."""

    name = "peer"

    def __init__(self, address: str, max_blob_bytes: int, timeout: float,
                 stats: TierStats) -> None:
        self.address = parse_address(address)
        self.max_blob_bytes = max_blob_bytes + HEADER_SLACK
        self.timeout = timeout
        self.stats = stats
        self._sock: socket.socket | None = None
        self._file = None
        self._lock = threading.Lock()

    def _connect(self) -> None:
        self._sock = socket.create_connection(self.address, timeout=self.timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")

    def _read(self, n: int) -> bytes:
        data = self._file.read(n)
        if data is None or len(data) != n:
            raise ConnectionError(f"the KV peer closed the connection ({len(data or b'')} of "
                                  f"{n} bytes)")
        return data

    def get(self, key: str) -> bytes | None:
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                self._sock.sendall(b"GET " + key.encode("ascii") + b"\n")
                (length,) = _LEN.unpack(self._read(_LEN.size))
                if length == MISSING:
                    return None
                if length > self.max_blob_bytes:
                    self.stats.add("errors", (self.name, "oversize"))
                    self._close()
                    return None
                return self._read(length)
            except (OSError, ConnectionError) as e:
                kind = "timeout" if isinstance(e, TimeoutError) else "unavailable"
                self.stats.add("errors", (self.name, kind))
                logger.warning("KV transfer from %s:%d failed (%s): the rest is recomputed",
                               *self.address, e)
                self._close()
                return None

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = self._file = None

    def put(self, key: str, blob: bytes) -> bool:
        return False  # read-only: the producer writes its own tiers

    def delete(self, key: str) -> None:
        pass  # a bad chunk is the producer's to drop; this consumer just recomputes it

    def contains(self, key: str) -> bool:
        return False  # not asked without reading (the cache report's explain skips peers)

    def close(self) -> None:
        with self._lock:
            self._close()
