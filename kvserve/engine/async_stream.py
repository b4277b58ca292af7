"""The asyncio side of the AsyncLLMEngine: the errors a request can end with, the per-request
`RequestStream`, and `deliver`, which the engine loop's thread hands its results to (in one
`call_soon_threadsafe` callback per iteration).

Why apart from the loop (engine/async_engine.py): this is all that runs on the event loop's
thread; the loop's file holds what runs on the engine's thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvserve.outputs import RequestOutput


class EngineQueueFullError(RuntimeError):
    """Too many requests are waiting; try again later (HTTP 429)."""


class EngineStepError(RuntimeError):
    """The engine step running this request raised; the request was aborted (HTTP 500)."""


class EngineRequestError(EngineStepError):
    """This request alone raised inside a step (e.g. while detokenized); it was stopped and
    its blocks freed, the other requests went on (HTTP 500 for this request only)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed) (HTTP 503)."""


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
        """Called on the asyncio loop (via `deliver`)."""
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
class Result:
    """A command's return value (kept apart from exceptions, which are values too)."""

    value: Any


def deliver(items: list[tuple[Any, Any]]) -> None:
    """Runs on the asyncio loop: route the loop thread's results to futures and streams."""
    for target, item in items:
        if isinstance(target, RequestStream):
            target._put(item)
        elif not target.done():
            if isinstance(item, BaseException):
                target.set_exception(item)
            elif isinstance(item, Result):
                target.set_result(item.value)
            else:
                target.set_result(item)
