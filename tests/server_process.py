"""A `kvserve serve` process for the tests (`python -m kvserve.entrypoints.cli serve` on a free port), its
log in a file, stopped with SIGINT as a user would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvserve.bench.spawn import wait_healthy
from kvserve.utils.ports import free_port

MAX_MODEL_LEN = 512


class ServerProcess:
    def __init__(self, name: str, args: list[str], log_dir: Path,
                 max_model_len: int = MAX_MODEL_LEN, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, KVSERVE_LOGGING_LEVEL="INFO", OMP_NUM_THREADS="2", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(self.port),
             "--max-model-len", str(max_model_len), "--num-threads", "2", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        try:
            wait_healthy(self.proc, self.url, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: {exc}:\n{self.log()}") from None

    def stop(self) -> int | None:
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return None if alive else self.proc.returncode


@contextlib.contextmanager
def running(proc: ServerProcess):
    """A module fixture's server: ready, handed out, stopped; it must still have been alive
    (a crash during the tests fails them with its log)."""
    try:
        proc.wait_ready()
        yield proc
    finally:
        code = proc.stop()
    assert code is None, proc.log()[-3000:]


@contextlib.contextmanager
def all_running(procs: dict[str, ServerProcess]):
    """`running` for several servers started together (their start-ups overlap): every one
    ready, handed out as the dict, stopped; each must still have been alive."""
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        codes = {name: proc.stop() for name, proc in procs.items()}
    for name, code in codes.items():
        assert code is None, procs[name].log()[-3000:]
