"""A streaming client of the OpenAI API (/v1/completions, /v1/chat/completions) that records
what a user sees: when each streamed chunk arrived.

TTFT is the time from sending the request to the first chunk that carries output (a choice in
/v1/completions; non-empty `content` or `reasoning_content` in a chat delta, so that a role-only
first chunk does not count); ITL are the gaps between such chunks; E2E (latency) ends at the
end of the stream. Token counts come from the final `usage` chunk (requested with
`stream_options.include_usage`), falling back to the number of output chunks when the server
sends none.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0  # time.perf_counter() when the request was sent
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between output chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # the response's (a gateway's replica)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completion_body(prompt: str | list[int], max_tokens: int, model: str | None,
                    ignore_eos: bool, temperature: float = 0.0) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    return _finish(body, model, ignore_eos)


def chat_body(messages: list[dict], max_tokens: int, model: str | None, ignore_eos: bool,
              temperature: float = 0.0) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    return _finish(body, model, ignore_eos)


def _finish(body: dict, model: str | None, ignore_eos: bool) -> dict:
    if model:
        body["model"] = model
    if ignore_eos:  # vLLM's and kvserve's extension; llama-server takes it as well
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict, chat: bool) -> str | None:
    """The output a chunk carries; None when it carries none (usage-only, role-only)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    if not chat:
        return "".join(c.get("text") or "" for c in choices)
    delta = "".join(((c.get("delta") or {}).get("content") or "")
                    + ((c.get("delta") or {}).get("reasoning_content") or "") for c in choices)
    return delta or None


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, split where the SSE spec splits them (CR, LF, CRLF) and
    nowhere else. httpx's aiter_lines also splits at NEL, U+2028 and U+2029, which JSON leaves
    raw and other servers (llama-server among them) send when a token decodes to one."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # a CR that ends the chunk may be the first half of a CRLF: wait for the next chunk
        parts = _SSE_LINE_END.split(pending[:-1] if pending.endswith("\r") else pending)
        pending = parts.pop() + ("\r" if pending.endswith("\r") else "")
        for line in parts:
            yield line
    for line in _SSE_LINE_END.split(pending):
        if line:
            yield line


async def stream_request(http: httpx.AsyncClient, url: str, body: dict,
                         headers: dict[str, str] | None = None) -> RequestResult:
    """POST `body` to `url` (a /v1/completions or /v1/chat/completions URL) and time the
    stream; a failure is recorded in the result, never raised."""
    chat = "messages" in body
    res = RequestResult(start=time.perf_counter())
    last, chunks, text = res.start, 0, []
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            res.headers = dict(r.headers)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                out = _chunk_text(chunk, chat)
                if out is not None:
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(out)
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
        res.latency = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks
        res.text = "".join(text)
        res.ok = chunks > 0
        if not res.ok:
            res.error = "the stream carried no output"
    except Exception as exc:  # counted as a failure; the load goes on
        res.error = f"{type(exc).__name__}: {exc}"
    return res
