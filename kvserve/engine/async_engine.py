"""AsyncLLMEngine: one LLMEngine stepped by a dedicated thread, driven from asyncio.

`LLMEngine` is not thread safe, so exactly one thread, the *engine loop*, ever touches it. Everyone
else talks to the loop through a command queue:

* `add_request` / `abort` / `call` put a command on a `collections.deque` (appends and pops are
  atomic) and set a `threading.Event` to wake the loop.
* The loop drains the commands between steps: it adds (validation happens here, inside
  `LLMEngine.add_request`, and its `ValueError` travels back to the caller), aborts, and runs
  calls such as `reset_prefix_cache`. Then it steps the engine while there is work, and sleeps on
  the event when there is none.
* Results go the other way through `loop.call_soon_threadsafe`: everything one iteration produced
  (outputs for many requests, the answers to the commands) is handed to the asyncio loop in ONE
  callback, which puts each output into the per-request `asyncio.Queue` of a `RequestStream`.

A request that fails inside a step on its own (`RequestOutput.error`) fails its stream alone
(`EngineRequestError`); a step that raises as a whole fails the requests it was running (their
streams get an `EngineStepError`, their blocks are freed by aborting them) and the loop goes on;
an error in the loop itself marks the engine dead and fails every stream (`EngineDeadError`).

Admission counts sequences (a request with n samples is n of them), not requests:
`max_waiting_requests` bounds the sequences waiting, and a request larger than that, or than
`max_seqs_per_request`, is refused as never fitting (ValueError, HTTP 400) rather than as
"busy" (EngineQueueFullError, HTTP 429), which is kept for what could succeed later.

Every `log_interval` seconds while busy the loop logs one line of throughput and cache figures on
the "kvserve" logger; `stat_loggers` (e.g. the server's Prometheus metrics) are called on the loop
thread after every step with what it produced.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.config import EngineConfig
from kvserve.worker.executor import ExecutorDied
from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.validation import DEFAULT_MAX_SEQS_PER_REQUEST, DEFAULT_MAX_WAITING_REQUESTS

logger = logging.getLogger("kvserve")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineQueueFullError", "EngineRequestError",
           "EngineStepError", "RequestStream", "StatLogger"]


class EngineQueueFullError(RuntimeError):
    """Too many requests are waiting; try again later (HTTP 429)."""


class EngineStepError(RuntimeError):
    """The engine step running this request raised; the request was aborted (HTTP 500)."""


class EngineRequestError(EngineStepError):
    """This request alone raised inside a step (e.g. while detokenized); it was stopped and
    its blocks freed, the other requests went on (HTTP 500 for this request only)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed) (HTTP 503)."""


class StatLogger(Protocol):
    """Called on the engine loop thread: must be quick and must not touch the engine's state
    other than reading it."""

    def on_step(self, engine: LLMEngine, outputs: Sequence[RequestOutput],
                streaming: frozenset[str] | set[str], now: float) -> None: ...

    def on_request_gone(self, request_id: str) -> None: ...

    def on_idle(self, engine: LLMEngine) -> None: ...


class RequestStream:
    """The asyncio side of one request.

    Outputs are cumulative snapshots (full text and tokens so far), so the stream keeps only the
    newest one not yet taken: a slow reader costs one snapshot of memory, not one per step, and
    simply sees bigger deltas.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called on the asyncio loop (via `_deliver`)."""
        if isinstance(self._latest, BaseException):
            return  # the request already failed: nothing after that matters
        if isinstance(self._latest, RequestOutput) and self._latest.finished:
            return  # never replace the final output
        self._latest = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output; raises the error that ended the request."""
        while self._latest is None:
            await self._ready.wait()
            self._ready.clear()
        item, self._latest = self._latest, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    stream: RequestStream
    future: asyncio.Future
    streaming: bool
    cache_salt: str | None
    priority: int
    arrival_time: float
    tenant: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


@dataclass
class _IntervalStats:
    """What the periodic log line reports, accumulated on the loop thread."""

    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    queries: int = 0
    hits: int = 0
    active: bool = False


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
                 log_stats: bool = True, log_interval: float = 10.0,
                 stat_loggers: Iterable[StatLogger] = ()) -> None:
        for name, value in (("max_waiting_requests", max_waiting_requests),
                            ("max_seqs_per_request", max_seqs_per_request)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_seqs_per_request = max_seqs_per_request
        self.log_stats = log_stats
        self.log_interval = log_interval
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self._commands: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        # Loop-thread state only.
        self._streams: dict[str, RequestStream] = {}
        self._streaming: set[str] = set()
        self._prompt_lens: dict[str, int] = {}  # prompt tokens of requests not yet counted
        self._gen_counts: dict[str, int] = {}  # generated tokens counted so far per request
        self._pending: list[tuple[Any, Any]] = []  # (stream or future, item) for asyncio
        self._interval = _IntervalStats()
        self._last_cache = (0, 0)
        self.num_step_errors = 0
        self._idle_work: Iterator[object] | None = None

    @classmethod
    def from_kwargs(cls, *, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
                    log_stats: bool = True, log_interval: float = 10.0,
                    stat_loggers: Iterable[StatLogger] = (),
                    **engine_kwargs: Any) -> "AsyncLLMEngine":
        """Build the LLMEngine from LLM()-style keyword arguments (vLLM's names)."""
        engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
        return cls(engine, max_waiting_requests=max_waiting_requests,
                   max_seqs_per_request=max_seqs_per_request, log_stats=log_stats,
                   log_interval=log_interval, stat_loggers=stat_loggers)

    def check_request_size(self, num_seqs: int, what: str = "this request") -> None:
        """Refuse (ValueError) a request of `num_seqs` sequences that could never be admitted,
        however idle the engine: telling its client to retry later would be a lie."""
        if num_seqs > self.max_seqs_per_request:
            raise ValueError(f"{what} asks for {num_seqs:,} sequences, but at most "
                             f"{self.max_seqs_per_request:,} are allowed per request "
                             "(--max-seqs-per-request)")
        if num_seqs > self.max_waiting_requests:
            raise ValueError(f"{what} asks for {num_seqs:,} sequences, but at most "
                             f"{self.max_waiting_requests:,} may wait at once "
                             "(--max-waiting-requests)")

    # -- read-only views, safe from any thread (set once at construction) -------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.model_max_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.dead_error is None)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine loop thread; outputs are delivered on `loop` (default: the running
        loop)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine-loop",
                                        daemon=True)
        self._thread.start()

    def run_when_idle(self, work: Iterator[object]) -> None:
        """Run `work` on the loop thread one piece (one `next`) at a time, whenever no request
        is waiting or running: start-up work that must not hold up serving (the server's GEMM
        warm-up). A request that comes meanwhile waits for one piece at most. Call before
        `start`."""
        self._idle_work = work

    def _idle_piece(self) -> bool:
        """One piece of the idle work; whether any is left."""
        try:
            next(self._idle_work)
            return True
        except StopIteration:
            pass
        except Exception:  # noqa: BLE001 - serving goes on without it
            logger.exception("start-up work run while idle failed")
        self._idle_work = None
        return False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step; pending requests fail with EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.engine.shutdown()

    # -- the asyncio side -------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}")
        if self._thread is None or self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | None = None, *, stream: bool = False,
                          cache_salt: str | None = None, priority: int = 0,
                          arrival_time: float | None = None,
                          tenant: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises what
        `LLMEngine.add_request` raises (ValueError/TypeError for bad input),
        EngineQueueFullError when too many requests wait, EngineDeadError."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        rs = RequestStream(request_id)
        self._commands.append(_Add(request_id, prompt, params or SamplingParams(), rs, future,
                                   stream, cache_salt, priority,
                                   time.time() if arrival_time is None else arrival_time,
                                   tenant))
        self._wakeup.set()
        if not self._thread.is_alive() and not future.done():  # it stopped meanwhile
            future.set_exception(EngineDeadError("the engine loop is not running"))
        try:
            await future
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
            raise
        return rs

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks (thread safe, returns at once; unknown ids are
        ignored)."""
        self._commands.append(_Abort(request_id))
        self._wakeup.set()

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, *, stream: bool = True,
                       cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; leaving early aborts it."""
        if request_id is None:
            import uuid

            request_id = uuid.uuid4().hex
        rs = await self.add_request(request_id, prompt, params, stream=stream,
                                    cache_salt=cache_salt, priority=priority)
        try:
            while True:
                out = await rs.get()
                yield out
                if out.finished:
                    return
        finally:
            if not rs.finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        self._check_alive()
        future = asyncio.get_running_loop().create_future()
        self._commands.append(_Call(fn, future))
        self._wakeup.set()
        return await future

    async def reset_prefix_cache(self) -> None:
        await self.call(lambda e: e.reset_prefix_cache())

    async def stats(self) -> EngineStats:
        return await self.call(lambda e: e.stats())

    # -- the loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._process_commands()
                self._flush()
                if engine.has_unfinished_requests():
                    self._step()
                    self._flush()
                self._maybe_log()
                if not engine.has_unfinished_requests() and not self._commands:
                    if self._idle_work is not None and self._idle_piece():
                        continue  # requests first, then the next piece
                    self._on_idle()
                    self._flush()
                    timeout = None
                    if self.log_stats and self._interval.active:
                        timeout = max(0.0, self._interval.start + self.log_interval
                                      - time.monotonic()) + 0.01
                    self._wakeup.wait(timeout)
        except BaseException as exc:  # the loop itself broke: nothing can be served any more
            logger.exception("the engine loop died")
            self.dead_error = exc
        finally:
            self._fail_all(EngineDeadError("the engine loop stopped" if self.dead_error is None
                                           else f"the engine loop died: {self.dead_error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, (_Add, _Call)):
                self._pending.append((cmd.future, error))
        for rid, rs in list(self._streams.items()):
            self._pending.append((rs, error))
            try:
                self.engine.abort_request(rid)
            except Exception:  # best effort: the process is going down or the engine is broken
                pass
        self._streams.clear()
        self._flush()

    def _process_commands(self) -> None:
        engine = self.engine
        waiting = len(engine.scheduler.waiting)  # sequences: each sample waits on its own
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Abort):
                if cmd.request_id in self._streams:
                    try:
                        engine.abort_request(cmd.request_id)
                    except Exception:  # keep serving the others
                        logger.exception("aborting request %s failed", cmd.request_id)
                    self._forget(cmd.request_id)
                    waiting = len(engine.scheduler.waiting)
            elif isinstance(cmd, _Add):
                if cmd.future.cancelled():
                    continue
                try:
                    self.check_request_size(cmd.params.n)
                except ValueError as exc:
                    self._pending.append((cmd.future, exc))
                    continue
                if waiting + cmd.params.n > self.max_waiting_requests:
                    self._pending.append((cmd.future, EngineQueueFullError(
                        f"the server is busy: {waiting} sequences are waiting and this request "
                        f"adds {cmd.params.n} (--max-waiting-requests "
                        f"{self.max_waiting_requests}); retry later")))
                    continue
                if cmd.request_id in self._streams:
                    self._pending.append((cmd.future, ValueError(
                        f"request id {cmd.request_id!r} is already in use")))
                    continue
                try:
                    engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id,
                                       arrival_time=cmd.arrival_time, stream=cmd.streaming,
                                       cache_salt=cmd.cache_salt, priority=cmd.priority,
                                       tenant=cmd.tenant)
                except Exception as exc:  # ValueError/TypeError: the caller's fault; else ours
                    self._pending.append((cmd.future, exc))
                    continue
                self._streams[cmd.request_id] = cmd.stream
                if cmd.streaming:
                    self._streaming.add(cmd.request_id)
                waiting += cmd.params.n
                self._pending.append((cmd.future, cmd.request_id))
            elif isinstance(cmd, _Call):
                try:
                    self._pending.append((cmd.future, _Result(cmd.fn(engine))))
                except Exception as exc:
                    self._pending.append((cmd.future, exc))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._streaming.discard(request_id)
        self._prompt_lens.pop(request_id, None)
        self._gen_counts.pop(request_id, None)
        for sl in self.stat_loggers:
            try:
                sl.on_request_gone(request_id)
            except Exception:
                logger.exception("stat logger failed")

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except ExecutorDied:
            raise  # no step can run any more: the loop dies (503), see worker/executor.py
        except Exception as exc:
            self.num_step_errors += 1
            logger.exception("engine step failed; failing the requests it was running")
            try:
                affected = {r.parent_id or r.request_id for r in engine.scheduler.running}
            except Exception:
                affected = set()
            if not affected:  # it failed before anything ran: fail everything it could touch
                affected = set(self._streams)
            error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
            for rid in affected:
                try:
                    engine.abort_request(rid)
                except Exception:
                    logger.exception("abort after a failed step failed for %s", rid)
                rs = self._streams.get(rid)
                if rs is not None:
                    self._pending.append((rs, error))
                self._forget(rid)
            return
        now = time.time()
        for out in outputs:
            rs = self._streams.get(out.request_id)
            if rs is not None:
                self._pending.append((rs, out if out.error is None else EngineRequestError(
                    f"the request failed in the engine: {out.error}")))
        self._count(outputs)
        for sl in self.stat_loggers:
            try:
                sl.on_step(engine, outputs, self._streaming, now)
            except Exception:
                logger.exception("stat logger failed")
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)

    def _on_idle(self) -> None:
        for sl in self.stat_loggers:
            try:
                sl.on_idle(self.engine)
            except Exception:
                logger.exception("stat logger failed")

    def _flush(self) -> None:
        """Hand everything produced so far to asyncio in one thread-safe callback."""
        if not self._pending:
            return
        items, self._pending = self._pending, []
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop closed under us (shutdown)
            pass

    # -- the periodic log line --------------------------------------------------------------
    def _count(self, outputs: Sequence[RequestOutput]) -> None:
        iv = self._interval
        if not iv.active:  # the first work after an idle spell opens the interval
            iv.start = time.monotonic()
            iv.active = True
        for out in outputs:
            rid = out.request_id
            if rid not in self._prompt_lens and rid not in self._gen_counts:
                iv.prompt_tokens += len(out.prompt_token_ids)
                self._prompt_lens[rid] = len(out.prompt_token_ids)
            total = sum(len(c.token_ids) for c in out.outputs)
            iv.generation_tokens += total - self._gen_counts.get(rid, 0)
            self._gen_counts[rid] = total

    def _maybe_log(self) -> None:
        try:
            self._log_line()
        except Exception:
            logger.exception("the stats log line failed")

    def _log_line(self) -> None:
        iv = self._interval
        now = time.monotonic()
        if not self.log_stats or not iv.active or now - iv.start < self.log_interval:
            return
        stats = self.engine.stats()
        elapsed = now - iv.start
        q, h = stats.prefix_cache_queries, stats.prefix_cache_hits
        dq, dh = max(0, q - self._last_cache[0]), max(0, h - self._last_cache[1])
        self._last_cache = (q, h)
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", iv.prompt_tokens / elapsed,
                    iv.generation_tokens / elapsed, stats.num_running, stats.num_waiting,
                    100.0 * stats.kv_cache_usage, 100.0 * dh / dq if dq else 0.0)
        self._interval = _IntervalStats(start=now,
                                        active=self.engine.has_unfinished_requests())


@dataclass
class _Result:
    """A command's return value (kept apart from exceptions, which are values too)."""

    value: Any


def _deliver(items: list[tuple[Any, Any]]) -> None:
    """Runs on the asyncio loop: route the loop thread's results to futures and streams."""
    for target, item in items:
        if isinstance(target, RequestStream):
            target._put(item)
        elif not target.done():
            if isinstance(item, BaseException):
                target.set_exception(item)
            elif isinstance(item, _Result):
                target.set_result(item.value)
            else:
                target.set_result(item)
