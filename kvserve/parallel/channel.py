"""The step message from the engine core to its workers, and each worker's reply.

The core pickles a message once and writes it into one shared-memory buffer that every worker
reads; a few bytes on each worker's pipe wake it (a pipe read blocks in the kernel: no worker
spins on a flag, which on a few shared cores would take the core its workers need). A message
larger than the buffer (a step loading many KV chunks) goes over the pipes whole. Replies come
back over each worker's pipe. The core sends the next message only after every worker replied
to the last one, so a worker never reads a buffer being rewritten. Ranks on other nodes get
the message from rank 0 over the process group (`RelayLink`, `GroupLink`).
"""

from __future__ import annotations

import pickle
import struct
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_CAPACITY = 64 << 20
_IN_BUFFER, _INLINE = b"S", b"P"


class Broadcast:
    """The core's end: one buffer, one pipe per worker."""

    def __init__(self, conns: list[Connection], capacity: int = DEFAULT_CAPACITY) -> None:
        self.conns = conns
        self.shm = shared_memory.SharedMemory(create=True, size=capacity)
        self.capacity = capacity

    @property
    def name(self) -> str:
        return self.shm.name

    def send(self, message: Any) -> None:
        blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(blob) <= self.capacity:
            self.shm.buf[: len(blob)] = blob
            header = _IN_BUFFER + struct.pack("<Q", len(blob))
            for conn in self.conns:
                conn.send_bytes(header)
        else:
            for conn in self.conns:
                conn.send_bytes(_INLINE + blob)

    def close(self) -> None:
        try:
            self.shm.close()
            self.shm.unlink()
        except (FileNotFoundError, BufferError):
            pass


class Receiver:
    """A worker's end."""

    def __init__(self, conn: Connection, shm_name: str) -> None:
        self.conn = conn
        self.shm = shared_memory.SharedMemory(name=shm_name)

    def receive(self) -> Any:
        data = self.conn.recv_bytes()
        if data[:1] == _IN_BUFFER:
            (n,) = struct.unpack("<Q", data[1:9])
            return pickle.loads(self.shm.buf[:n])
        return pickle.loads(data[1:])

    def reply(self, message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self.shm.close()


def read_reply(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class GroupLink:
    """A rank on another node: its messages come from rank 0 over the process group (a
    broadcast in a gloo group of rank 0 and the remote ranks, with no timeout that an idle
    engine could reach), its replies go back to rank 0 with a gather."""

    def __init__(self, group) -> None:
        self.group = group

    def receive(self) -> Any:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def reply(self, message: Any) -> None:
        import torch.distributed as dist

        dist.gather_object(message, None, dst=0, group=self.group)

    def close(self) -> None:
        pass


class RelayLink:
    """Rank 0 when some ranks are on other nodes: each message from the core goes on to them
    (GroupLink), and its reply to the core carries theirs: ("relayed", [rank 0's, theirs...]).
    """

    def __init__(self, inner: Receiver, group, size: int) -> None:
        self.inner, self.group, self.size = inner, group, size

    def receive(self) -> Any:
        import torch.distributed as dist

        message = self.inner.receive()
        dist.broadcast_object_list([message], src=0, group=self.group)
        return message

    def reply(self, message: Any) -> None:
        import torch.distributed as dist

        replies = [None] * self.size
        dist.gather_object(message, replies, dst=0, group=self.group)
        self.inner.reply(("relayed", replies))

    def close(self) -> None:
        self.inner.close()
