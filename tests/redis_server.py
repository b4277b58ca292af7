"""A real redis-server on a free port, that a test may kill, restart or put to sleep (also used
by benchmarks/bench_tiers.py). The test command installs redis-server with apt-get when it is
missing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

from kvserve.utils.ports import free_port


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed: `make test` installs it "
                                    "with apt-get (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--enable-debug-command", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_redis() -> RedisServer:
    """A RedisServer for a fixture: a missing redis-server fails the test, or skips it where
    KVSERVE_SKIP_REDIS=1 says this machine has none on purpose."""
    import os

    import pytest

    try:
        return RedisServer()
    except FileNotFoundError as e:
        if os.environ.get("KVSERVE_SKIP_REDIS") == "1":
            pytest.skip(str(e))
        pytest.fail(str(e))
