"""A grammar compile in a child process, so that it can be stopped.

Why a process: xgrammar's `compile_grammar` is one C++ call that nothing can interrupt inside a
thread, and a hostile JSON schema keeps it busy for minutes (4,000 optional properties: several
minutes of one core). A process can be killed the moment its time limit passes or its last
caller leaves, and the core is free at once.

Why only a trial: the compiled grammar cannot come back cheaply. xgrammar 0.2.9 can serialize
it (`CompiledGrammar.serialize_json`), but the text is huge (1,500 required properties on a
2,048-token vocabulary: 546 MB, 19 s to write and 9 s to read, where compiling took 0.12 s). So
the child compiles the grammar to learn that it is valid and how long it takes, and the parent
compiles it again on its own thread, knowing that this second compile ends within about the
same time (it is bounded by the time limit the trial met).

The child reads pickled `StructuredOutputsParams` from a pipe end the parent passed it and
answers ("ok", seconds) or ("invalid", reason). It ignores SIGINT (the server stops it) and
exits when its parent dies: a watchdog thread sees the parent pid change (xgrammar releases the
GIL while it compiles, so the watchdog runs even then), and a closed pipe ends the loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process
POLL_S = 0.05  # how often a waiting parent looks at its job's cancel flag
WATCHDOG_S = 0.5  # how often a child checks that its parent is alive
EXIT_WAIT_S = 5.0  # how long a parent waits for a dead child's exit code


@dataclass(frozen=True)
class Trial:
    """How a trial compile ended: ok, invalid (with the library's reason), timeout, cancelled,
    or died (the child exited without answering; `reason` says how)."""

    outcome: str
    seconds: float = 0.0
    reason: str = ""


class CompileWorker:
    """The parent's handle on one child process; one job at a time, from one thread."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._sent = False  # the vocabulary went to the child
        self.closed = False  # for good: no child is started again

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def start(self) -> None:
        """Spawn the child (it imports xgrammar on its own time); no-op if one is alive or
        the worker is closed."""
        if self.closed or (self._proc is not None and self._proc.poll() is None):
            return
        self.kill()  # a child that died by itself: reaped, its pipe closed
        ours, theirs = Pipe(duplex=True)
        fd = theirs.fileno()
        # A new session: a Ctrl-C at the terminal reaches the server, which stops its children.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.structured.compile_worker", str(fd), str(os.getpid())],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        theirs.close()
        # The vocabulary goes in ready(): a big one fills the pipe until the child reads it,
        # after its imports, and the caller here must not wait for that.
        self._conn, self._ready, self._sent = ours, False, False

    def ready(self, cancelled: Callable[[], bool]) -> bool:
        """Start the child if none is alive and wait until it can compile (it has imported
        xgrammar); False if it died starting or `cancelled()` turned true (it is killed)."""
        self.start()
        conn = self._conn
        if conn is None:  # closed
            return False
        if not self._sent:
            try:
                conn.send(self._info)
            except OSError:  # the child died before reading it
                self.kill()
                return False
            self._sent = True
        if not self._ready:
            answer = self._wait(time.monotonic() + STARTUP_TIMEOUT_S, cancelled)
            if not isinstance(answer, tuple):
                self.kill()
                return False
            self._ready = True
        return True

    def trial(self, params, timeout_s: float, cancelled: Callable[[], bool]) -> Trial:
        """Compile `params` in the child within `timeout_s` seconds of compile time (the child's
        start-up does not count), giving up as soon as `cancelled()` is true. A timed-out or
        cancelled child is killed (the next trial starts a fresh one)."""
        if not self.ready(cancelled):
            return Trial("cancelled") if cancelled() or self.closed else \
                Trial("died", reason="the compiler process did not start")
        conn = self._conn
        try:
            conn.send(params)  # type: ignore[union-attr]
        except (AttributeError, OSError):  # closed meanwhile (the process is exiting)
            return Trial("cancelled")
        answer = self._wait(time.monotonic() + timeout_s, cancelled)
        if not isinstance(answer, tuple):
            return self._stop(answer)
        kind, value = answer
        return Trial("ok", seconds=value) if kind == "ok" else Trial("invalid", reason=value)

    def _wait(self, deadline: float, cancelled: Callable[[], bool]) -> tuple | str:
        """The child's next message, or why none came: timeout, cancelled or died."""
        conn = self._conn  # close() from another thread (at exit) sets None: this one fails
        while True:
            if cancelled() or self.closed or conn is None:
                return "cancelled"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            try:
                if conn.poll(min(POLL_S, left)):
                    return conn.recv()
            except (EOFError, OSError):
                return "cancelled" if self.closed else "died"

    def _stop(self, outcome: str) -> Trial:
        code = self._exit_code() if outcome == "died" else None
        self.kill()
        reason = f"the compiler process exited with code {code} while compiling it" \
            if outcome == "died" else ""
        return Trial(outcome, reason=reason)

    def _exit_code(self) -> int | None:
        """The dead child's exit code. Its pipe closes a moment before the kernel can report
        the exit, so a bare poll() on a busy machine said "code None"; wait a little for it."""
        proc = self._proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Kill the child and start none again."""
        self.closed = True
        self.kill()

    def kill(self) -> None:
        """Stop the child now (SIGKILL: a compile does not listen) and reap it. Safe from two
        threads at once (the finalizer at exit, the worker's own thread)."""
        conn, self._conn = self._conn, None
        proc, self._proc = self._proc, None
        self._ready = False
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------
# the child
# ------------------------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (re-parented children see another parent pid)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(WATCHDOG_S)


def serve(conn: Connection) -> None:
    """Answer trial compiles until the pipe closes."""
    import xgrammar as xgr

    from kvserve.structured.grammar import build_grammar, library_reason

    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", 0.0))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return
        started = time.monotonic()
        try:
            compiler.compile_grammar(build_grammar(params))
        except Exception as exc:  # xgrammar's errors for an invalid schema, regex or grammar
            conn.send(("invalid", library_reason(exc)))
            continue
        conn.send(("ok", time.monotonic() - started))


def main(argv: list[str]) -> None:
    fd, parent = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    serve(Connection(fd))


if __name__ == "__main__":
    main(sys.argv[1:])
