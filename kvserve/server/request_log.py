"""`kvserve serve --request-log FILE`: one JSON line per finished engine request, for
`kvserve diagnose` (kvserve/diagnose/) to replay.

Why a log of its own: the prefix-cache hit rate /metrics reports says how much was reused, not
why the rest was not. Diagnosing that needs the prompts as the clients sent them (the chat
messages, before the template), the cache salt, and what the cache actually served, in arrival
order. The first line of each server run is a header, `{"meta": {...}}`, with the pool's block
size and block count, so that diagnose replays at the server's own pool size by default; a
`/reset_prefix_cache` writes `{"event": "reset_prefix_cache", "time"}`, since a replay that
did not empty its cache there would credit hits the server never had (a restart, a new header,
empties it too).

Each record has its arrival `time` and its `finished` time: requests that overlapped can be
told from requests sent one after another (diagnose's replay is sequential, docs/diagnose.md).
The log is append-only and flushed per line (a crash loses at most the line being written); a
write that fails is logged once and the server goes on serving: a full disk must not turn
into failed requests.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from kvserve.utils.jsonl import json_line
from kvserve.server.protocol import ChatCompletionRequest

logger = logging.getLogger("kvserve")

FORMAT = "kvserve-request-log"
VERSION = 1


class RequestLog:
    """An append-only JSONL file; `write` never raises."""

    def __init__(self, path: str | Path, meta: dict[str, Any]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._failed = False
        self._file = None
        try:
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        except OSError as exc:
            self._fail(exc)
        self.write({"meta": {"format": FORMAT, "version": VERSION, "started": time.time(),
                             **meta}})

    def _fail(self, exc: BaseException) -> None:
        if not self._failed:
            logger.error("request log %s: %s (requests are served, not logged)", self.path, exc)
        self._failed = True

    def write(self, record: dict[str, Any]) -> None:
        """Append one line; a failure is logged (once until a write succeeds), not raised."""
        if self._file is None:
            return
        try:
            line = json_line(record) + "\n"
            with self._lock:
                self._file.write(line)
                self._file.flush()
            self._failed = False
        except (OSError, TypeError, ValueError) as exc:
            self._fail(exc)

    def log_finished(self, req, prompts: list[dict[str, Any]], engine_ids: list[str],
                     outputs, arrival: float, namespace: str | None = None) -> None:
        """One line per finished engine request of a chat or completions request (a chat
        request is one prompt; a completions request may hold several). `namespace`: the
        cache namespace the request was served in (kvserve/frontend/tenancy.py), written as
        "namespace" when it is not the request's own cache_salt (--kv-isolation api_key or
        none), so that `kvserve diagnose` replays the sharing that happened."""
        for prompt, rid, out in zip(prompts, engine_ids, outputs):
            if out is None or not out.finished:
                continue
            n, cached = len(out.prompt_token_ids), out.num_cached_tokens
            if isinstance(req, ChatCompletionRequest):
                record = chat_record(req, arrival, n, cached, rid)
            else:
                record = completion_record(prompt, arrival, req.cache_salt, n, cached, rid)
            if namespace != req.cache_salt:
                record["namespace"] = namespace
            self.write(record)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._fail(exc)
            self._file = None


def chat_record(req, arrival: float, prompt_tokens: int, cached_tokens: int,
                request_id: str) -> dict[str, Any]:
    """A /v1/chat/completions request as it was received (messages, tools, template kwargs)."""
    body = req.model_dump(mode="json", exclude_none=True)
    record: dict[str, Any] = {"time": arrival, "id": request_id, "endpoint": "chat",
                              "cache_salt": req.cache_salt, "messages": body["messages"]}
    for key in ("tools", "chat_template_kwargs"):
        if key in body:
            record[key] = body[key]
    if req.add_generation_prompt is False:
        record["add_generation_prompt"] = False
    record.update(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                  finished=time.time())
    return record


def completion_record(prompt: dict[str, Any], arrival: float, salt: str | None,
                      prompt_tokens: int, cached_tokens: int,
                      request_id: str) -> dict[str, Any]:
    """One prompt of a /v1/completions request: its text, or its token ids when it came so."""
    record: dict[str, Any] = {"time": arrival, "id": request_id, "endpoint": "completions",
                              "cache_salt": salt}
    if prompt.get("prompt") is not None:
        record["prompt"] = prompt["prompt"]
    else:
        record["prompt_token_ids"] = list(prompt["prompt_token_ids"])
    record.update(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                  finished=time.time())
    return record
