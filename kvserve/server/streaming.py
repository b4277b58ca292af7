"""Server-sent events: how a streamed response goes out, and ends however the client ends it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from kvserve.utils.jsonl import json_line


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event carrying `obj` as compact JSON on one line (kvserve.utils.jsonl), named
    `event` if given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json_line(obj)}\n\n"


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always cleans up when the response ends, however it ends.

    When the client goes away while the generator waits for tokens, Starlette cancels it there
    and its `finally` aborts the engine requests. But the client may also go away while a write
    is pending (the generator is then suspended at a `yield`: closing it runs the `finally`) or
    before the generator ever ran (then only `on_close` can abort the requests)."""

    def __init__(self, content: AsyncIterator[str], on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


def event_stream(events: AsyncIterator[str], on_close) -> StreamingResponse:
    return _EventStreamResponse(events, on_close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def transfer_field(outputs) -> dict[str, Any]:
    """A producer's `kv_transfer_params` (vLLM's top-level field: what the decode instance
    needs), when the request asked for a remote decode; else nothing."""
    params = next((o.kv_transfer_params for o in outputs
                   if o is not None and o.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params is not None else {}


def reports_field(outputs) -> dict[str, Any]:
    """The `kv_cache_report` of a response (one object, or a list for several prompts)."""
    reports = [None if o is None else o.kv_cache_report for o in outputs]
    return {"kv_cache_report": reports[0] if len(reports) == 1 else reports}


async def wait_for_disconnect(raw) -> None:
    """Return when the client closes the connection. The body was read already, so the next
    ASGI message the server delivers is the disconnect (uvicorn holds `receive` until then)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
