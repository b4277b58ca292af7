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

The asyncio side (the errors below, `RequestStream`, the delivery) is engine/async_stream.py.

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
thread after every step with what it produced and one `EngineStats` snapshot
(`LLMEngine.step_stats`), the same for all of them: a stat logger sees figures, never the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.config import EngineConfig
from kvserve.worker.executor import ExecutorDied
from kvserve.engine.async_stream import (EngineDeadError, EngineQueueFullError,
                                         EngineRequestError, EngineStepError, RequestStream,
                                         Result, deliver)
from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.log_line import ThroughputLog
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.structured.params import StructuredOutputsParams
from kvserve.utils.validation import DEFAULT_MAX_SEQS_PER_REQUEST, DEFAULT_MAX_WAITING_REQUESTS

logger = logging.getLogger("kvserve")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineQueueFullError", "EngineRequestError",
           "EngineStepError", "RequestStream", "StatLogger"]


class StatLogger(Protocol):
    """Called on the engine loop thread: must be quick. It is handed an `EngineStats` snapshot
    taken once per step (and once when the loop goes idle), never the engine itself, so what
    it reports cannot depend on, or disturb, the engine's internals."""

    def on_step(self, stats: EngineStats, outputs: Sequence[RequestOutput],
                streaming: frozenset[str] | set[str], now: float) -> None: ...

    def on_request_gone(self, request_id: str) -> None: ...

    def on_idle(self, stats: EngineStats) -> None: ...


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
        self._pending: list[tuple[Any, Any]] = []  # (stream or future, item) for asyncio
        self._log = ThroughputLog(log_interval)  # the periodic log line (engine/log_line.py)
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
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.engine.kv.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the device KV pool."""
        return self.engine.kv.num_blocks

    @property
    def model(self) -> torch.nn.Module | None:
        """The model in this process, for start-up work such as the server's GEMM warm-up;
        None under tensor parallelism (the model is in the workers)."""
        return self.engine.model

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

    # -- what the server asks of the engine, by name (it never reaches into the LLMEngine:
    # tests/test_architecture.py); each runs on the loop thread between steps -------------
    async def explain_cache(self, prompt: PromptType, cache_salt: str | None = None,
                            prompt_logprobs: int | None = None, full: bool = True) -> dict:
        """The cache report a request for `prompt` would get now, without running it
        (`LLMEngine.explain_cache`)."""
        return await self.call(
            lambda e: e.explain_cache(prompt, cache_salt, prompt_logprobs, full=full))

    async def pin_room(self, prompt: PromptType, cache_salt: str | None, owner: str) -> int:
        """The blocks a pin of `prompt` takes; raises PinLimitError or ValueError when it
        cannot be pinned (`LLMEngine.pin_room`)."""
        return await self.call(lambda e: e.pin_room(prompt, cache_salt, owner))

    async def pin_prefix(self, prompt: PromptType, cache_salt: str | None,
                         owner: str) -> dict | None:
        """Pin the prompt's cached blocks; None when the device does not hold them all
        (`LLMEngine.pin_prefix`)."""
        return await self.call(lambda e: e.pin_prefix(prompt, cache_salt, owner))

    async def unpin(self, pin_id: str, owner: str | None) -> dict | None:
        """Release a pin; None if `owner` (None: anyone's) has none of that id."""
        return await self.call(lambda e: e.unpin(pin_id, owner))

    async def list_pins(self, owner: str | None) -> dict:
        """`owner`'s pins and budget, or (None) every pin (`LLMEngine.list_pins`)."""
        return await self.call(lambda e: e.list_pins(owner))

    async def prefix_tree(self, limit: int) -> dict:
        """The largest shared prefixes of the device's cache (`LLMEngine.prefix_tree`)."""
        return await self.call(lambda e: e.prefix_tree(limit))

    def submit_grammar(self, params: StructuredOutputsParams,
                       tenant: Hashable) -> concurrent.futures.Future:
        """Compile a request's grammar in the compiler's processes, in `tenant`'s turn (the
        compiler is thread safe: called from any thread, never on the loop's); the future's
        exception is a ValueError for a grammar that cannot be used. The engine then finds it
        in its cache when the request is added."""
        return self.engine.grammars.submit(params, tenant)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Have `stat_logger` called after every step from now on (once: a logger already
        there is not added twice). Call before `start`."""
        if stat_logger not in self.stat_loggers:
            self.stat_loggers.append(stat_logger)

    def state_sizes(self) -> dict[str, int]:
        """Sizes of every per-request map of this loop and the engine below it: all of them
        must be empty when idle (the server's memory diagnostics; read from another thread,
        so a busy engine's figures are approximate)."""
        return {"async._streams": len(self._streams), "async._streaming": len(self._streaming),
                "async._log": len(self._log), "async._commands": len(self._commands),
                **self.engine.state_sizes()}

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
                    self._wakeup.wait(self._log.seconds_left() if self.log_stats else None)
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
                    self._pending.append((cmd.future, Result(cmd.fn(engine))))
                except Exception as exc:
                    self._pending.append((cmd.future, exc))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._streaming.discard(request_id)
        self._log.forget(request_id)
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
        self._log.count(outputs)
        stats = self._step_stats()
        for sl in self.stat_loggers if stats is not None else ():
            try:
                sl.on_step(stats, outputs, self._streaming, now)
            except Exception:
                logger.exception("stat logger failed")
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)

    def _on_idle(self) -> None:
        stats = self._step_stats()
        for sl in self.stat_loggers if stats is not None else ():
            try:
                sl.on_idle(stats)
            except Exception:
                logger.exception("stat logger failed")

    def _maybe_log(self) -> None:
        """The periodic log line, when an interval of work has passed."""
        try:
            if self.log_stats and self._log.due():
                self._log.write(self.engine.stats(), self.engine.has_unfinished_requests())
        except Exception:
            logger.exception("the stats log line failed")

    def _step_stats(self) -> EngineStats | None:
        """The one snapshot this step's stat loggers share (None: there are none, or it
        failed, which is logged: serving goes on without the figures)."""
        if not self.stat_loggers:
            return None
        try:
            return self.engine.step_stats()
        except Exception:
            logger.exception("the stats snapshot for the stat loggers failed")
            return None

    def _flush(self) -> None:
        """Hand everything produced so far to asyncio in one thread-safe callback."""
        if not self._pending:
            return
        items, self._pending = self._pending, []
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:  # the event loop closed under us (shutdown)
            pass
