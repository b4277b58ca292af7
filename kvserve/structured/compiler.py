"""The grammar compiler: bounded, fair across tenants, stopped when nobody waits (issue 63).

`GrammarCompiler` turns a `StructuredOutputsParams` into a compiled grammar off the engine step
and caches the result by the digest of the grammar's spec, so that a thousand requests with one
schema compile it once; the cache holds futures, so requests that arrive while it compiles wait
for the same compile. Why so much machinery: one hostile JSON schema (thousands of optional
properties) keeps xgrammar busy for minutes, and with one compile thread and no bound it held
every other caller's structured output that long. Now each compile is first tried in a child
process that can be killed (kvserve/structured/compile_worker.py says why a process, and why
only a trial), compiles are taken from per-tenant queues in turn
(kvserve/structured/fair_queue.py), a grammar over `max_schema_bytes` is refused before it
compiles and one past `compile_timeout` seconds is stopped, each with a message that names the
limit and its flag.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from kvserve.structured.compile_worker import CompileWorker
from kvserve.structured.fair_queue import FairQueue
from kvserve.structured.grammar import (GrammarState, _xgr, build_grammar, library_reason,
                                        vocab_type)
from kvserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("kvserve")

CACHE_SIZE = 512  # compiled grammars kept (LRU)
# ... and at most this many bytes of them (xgrammar's own count): 4,000 required properties
# compile to 13 MB on a 2,048-token vocabulary, so 512 big grammars would be gigabytes.
CACHE_BYTES = 1 << 30


class GrammarLimitError(ValueError):
    """A grammar over one of the server's bounds (its size, its compile time): a 400 that names
    the limit and the flag that sets it."""


@dataclass(eq=False)
class _Job:
    """One grammar's compile, shared by every request that waits for it."""

    params: StructuredOutputsParams
    key: str
    tenant: Hashable
    future: Future = field(default_factory=Future)  # the compiled grammar, once
    waiters: int = 0  # requests waiting on `future` (through their own futures)
    state: str = "queued"  # queued, running, done
    nbytes: int = 0  # the compiled grammar's size, once done


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and model vocabulary size.

    Each compile is first tried in a killable child process (`compile_worker`), at most
    `workers` at once, taken from per-tenant queues in turn (`FairQueue`); a tenant runs at most
    `workers - 1` of them (one when there is one worker), so another tenant's small schema
    always finds a free worker. A compile past `compile_timeout` seconds, or whose every caller
    left (`submit`'s future cancelled), has its process killed. The cache holds compiled
    grammars (and compiles that ran out of time) by the digest of their spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 workers: int = 2, compile_timeout: float = 10.0,
                 max_schema_bytes: int = 1 << 20) -> None:
        xgr = _xgr()
        special = set(tokenizer.all_special_ids) - set(stop_token_ids)
        # An empty string marks a token the grammar never allows (special tokens, and the
        # model's padding ids past the tokenizer's vocabulary).
        vocab = [("" if i in special else (tokenizer.id_to_token(i) or ""))
                 for i in range(vocab_size)]
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(vocab, vocab_type(tokenizer), vocab_size=vocab_size,
                                      stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.compile_timeout = compile_timeout
        self.max_schema_bytes = max_schema_bytes
        self._cache: OrderedDict[str, _Job] = OrderedDict()
        self._queue: FairQueue[_Job] = FairQueue(per_tenant=max(1, workers - 1))
        self._lock = threading.Condition()
        self._closed = False
        self.num_compiles = 0  # compiles in this process (after their trial)
        self.num_cancelled = 0  # compiles dropped or killed because their callers left
        info = self.info.serialize_json()
        self._workers = [CompileWorker(info) for _ in range(workers)]
        for worker in self._workers:
            worker.start()  # the children import xgrammar while the first request arrives
        self._finalizer = weakref.finalize(self, _kill_all, list(self._workers))
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True,
                                          name=f"kvserve-grammar-{i}")
                         for i, w in enumerate(self._workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, params: StructuredOutputsParams, tenant: Hashable = None) -> Future:
        """The compiled grammar for `params`, as a future (done at once on a cache hit). Its
        exception is a ValueError saying why: the library's reason for an invalid grammar, or
        the limit it is over (GrammarLimitError). Cancelling the future says the caller left;
        when every caller of a compile has left, the compile stops."""
        size = params.size()
        if size > self.max_schema_bytes:
            return _failed(GrammarLimitError(
                f"the {params.kind} for structured outputs is {size:,} bytes, over the limit of "
                f"{self.max_schema_bytes:,} bytes (--structured-outputs-max-schema-bytes)"))
        key = params.key()
        with self._lock:
            if self._closed:
                return _failed(RuntimeError("the grammar compiler is closed"))
            job = self._cache.get(key)
            if job is not None and job.future.done():
                self._cache.move_to_end(key)
                return job.future
            if job is None:
                job = self._add_job(params, key, tenant)
            job.waiters += 1
        mine: Future = Future()
        job.future.add_done_callback(lambda done: _pass_on(done, mine))
        mine.add_done_callback(lambda f: f.cancelled() and self._leave(job))
        return mine

    def compile(self, params: StructuredOutputsParams):
        """Blocking form of `submit`."""
        return self.submit(params).result()

    def _add_job(self, params: StructuredOutputsParams, key: str, tenant: Hashable) -> _Job:
        """A new queued compile (under the lock), cached at once so that callers share it."""
        job = _Job(params, key, tenant)
        self._cache[key] = job
        self._evict()
        self._queue.push(tenant, job)
        self._lock.notify_all()
        return job

    def _leave(self, job: _Job) -> None:
        """A caller left: with none left, drop the compile (a running one's process is killed
        by its worker thread, which watches the future)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            self._forget(job)
            if job.state == "queued":
                self._queue.remove(job)
            job.future.cancel()
            self.num_cancelled += 1
        logger.info("grammar compile %s cancelled (%s): no request waits for it",
                    job.key[:12], job.state)

    def _evict(self) -> None:
        """Drop the least recently used finished compiles (under the lock) until the cache is
        within CACHE_SIZE grammars and CACHE_BYTES; compiles in flight stay until they end."""
        total = sum(job.nbytes for job in self._cache.values())
        for key in list(self._cache):
            if len(self._cache) <= CACHE_SIZE and total <= CACHE_BYTES:
                return
            job = self._cache[key]
            if job.future.done():
                total -= job.nbytes
                del self._cache[key]

    def _forget(self, job: _Job) -> None:
        if self._cache.get(job.key) is job:
            del self._cache[job.key]

    def _next(self) -> _Job | None:
        """The next compile for a worker thread (waiting for one), None once closed."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                job = self._queue.pop()
                if job is not None:
                    job.state = "running"
                    return job
                self._lock.wait()

    def _serve(self, worker: CompileWorker) -> None:
        """One worker thread: take a compile, try it in the child, compile it here if valid."""
        while True:
            # Ready before taking a compile: a fresh child still importing xgrammar must not
            # hold a compile that an idle worker could run now.
            if not worker.ready(lambda: self._closed):
                if self._closed or worker.closed:
                    break
                logger.error("a grammar compile process failed to start: retrying")
                time.sleep(1.0)
                continue
            job = self._next()
            if job is None:
                break
            try:
                self._run(worker, job)
            except BaseException as exc:  # never leave a caller waiting
                _settle(job.future, exc=RuntimeError(f"grammar compile failed: {exc!r}"))
            finally:
                with self._lock:
                    job.state = "done"
                    self._queue.finish(job)
                    self._lock.notify_all()
        worker.close()

    def _run(self, worker: CompileWorker, job: _Job) -> None:
        trial = worker.trial(job.params, self.compile_timeout,
                             lambda: job.future.cancelled() or self._closed)
        if not self._closed:
            worker.start()  # a killed child's successor imports xgrammar meanwhile
        if trial.outcome == "cancelled":
            return
        if trial.outcome == "ok":
            compiled, exc = self._compile_here(job.params)
        elif trial.outcome == "timeout":  # kept in the cache: the same schema fails at once
            logger.warning("grammar compile %s (tenant %s) ran past %ss: stopped",
                           job.key[:12], job.tenant, self.compile_timeout)
            compiled, exc = None, GrammarLimitError(
                f"compiling the {job.params.kind} for structured outputs took over "
                f"{self.compile_timeout:g} s, the limit (--structured-outputs-compile-timeout): "
                "simplify it (fewer optional properties, alternatives or nesting)")
        else:
            compiled, exc = None, ValueError(
                f"invalid {job.params.kind} for structured outputs: {trial.reason}")
        _settle(job.future, compiled, exc)
        with self._lock:
            if exc is not None and not isinstance(exc, GrammarLimitError):
                self._forget(job)  # a bad grammar is not worth keeping
            elif compiled is not None:
                job.nbytes = compiled.memory_size_bytes
                self._evict()

    def _compile_here(self, params: StructuredOutputsParams) -> tuple[Any, BaseException | None]:
        """The compiled grammar (its trial passed, so this ends in about the trial's time)."""
        with self._lock:
            self.num_compiles += 1
        try:
            return self._compiler.compile_grammar(build_grammar(params)), None
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors: say why
            return None, ValueError(f"invalid {params.kind} for structured outputs: "
                                    f"{library_reason(exc)}")

    def grammar(self, params: StructuredOutputsParams):
        """The (uncompiled) xgrammar Grammar for `params`."""
        return build_grammar(params)

    def new_state(self, compiled) -> "GrammarState":
        return GrammarState(_xgr().GrammarMatcher(compiled))

    def worker_pids(self) -> list[int]:
        """The compile processes alive now (tests look for orphans)."""
        return [pid for pid in (w.pid for w in self._workers) if pid is not None]

    def close(self) -> None:
        """Stop the workers (killing any compile) and fail what still waits."""
        with self._lock:
            self._closed = True
            pending = [job for job in self._cache.values() if not job.future.done()]
            self._lock.notify_all()
        for job in pending:
            _settle(job.future, exc=RuntimeError("the grammar compiler is closed"))
        for thread in self._threads:
            thread.join(timeout=5)
        self._finalizer()


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def _settle(future: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless it is already set or cancelled (its callers left)."""
    try:
        if not future.set_running_or_notify_cancel():
            return  # cancelled
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except (RuntimeError, InvalidStateError):  # already running or done: set elsewhere
        pass


def _pass_on(done: Future, mine: Future) -> None:
    """A shared compile's outcome, to one caller's future (unless that caller left)."""
    if done.cancelled():
        return  # cancelled only once every caller's own future was
    _settle(mine, done.result() if done.exception() is None else None, done.exception())


def _kill_all(workers: list[CompileWorker]) -> None:
    """The finalizer (close(), or the interpreter's exit): no compile process is left."""
    for worker in workers:
        worker.close()
