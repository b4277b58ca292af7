"""A server process for a benchmark: started on a free port of 127.0.0.1 in its own session,
waited for (/health 200), stopped with SIGINT (then SIGKILL) to its whole process group, so
that no process outlives the benchmark."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def kvserve_command(port: int, model: str | None = None, extra: list[str] | None = None) -> list:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return cmd + ([model] if model else []) + list(extra or [])


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s")


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB; NaN where /proc does not say."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def server(cmd: list[str], port: int, timeout: float = 300.0, log=None,
           env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `cmd` (a server listening on `port`) for the block: (its URL, the process)."""
    print(f"starting: {' '.join(map(str, cmd))}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout)
        yield url, proc
    finally:
        stop(proc)
