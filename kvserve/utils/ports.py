"""A free TCP port on 127.0.0.1, for a process this one is about to start (a server, a
worker group's rendezvous, a test's Redis).

The port is found by binding port 0 and letting the socket go: another process could take it
before ours binds, so a caller that starts a server checks that it came up (they all wait for
/health or a connection) rather than trusting the number."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
