"""Request logs in: kvserve's own (`kvserve serve --request-log`) and OpenAI-format JSONL.

Three line shapes, mixed freely in one file:

- kvserve's: `{"time", "cache_salt", "messages" | "prompt" | "prompt_token_ids",
  "prompt_tokens", "cached_tokens", ...}` (and `"namespace"`, the one the cache used, under
  `--kv-isolation api_key` or `none`: diagnose replays by it) after a header `{"meta":
  {"block_size", "pool_blocks", ...}}` (kvserve/server/request_log.py writes both);
- a request body of `/v1/chat/completions` (`{"messages": [...], ...}`) or `/v1/completions`
  (`{"prompt": ...}`), as a client or proxy would log it;
- the batch API's line, `{"custom_id", "method", "url", "body": {...}}`.

Why one reader for all: the question "why are my prefix-cache hits low" comes with whatever log
the user has; what diagnose needs from any of them is the prompt as the client sent it, in order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.utils.jsonl import json_line, read_jsonl


@dataclass
class LogRecord:
    """One request: either chat `messages` (with `tools` and template kwargs) or a completion
    `prompt` (text or token ids)."""

    index: int
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    cache_salt: str | None = None
    time: float | None = None
    finished: float | None = None  # kvserve's log: when the request finished
    prompt_tokens: int | None = None  # what the server counted (kvserve's log only)
    cached_tokens: int | None = None  # what the server's prefix cache served

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def copy(self, **changes: Any) -> "LogRecord":
        return replace(self, **changes)


@dataclass
class RequestLog:
    records: list[LogRecord]
    block_size: int | None = None  # from kvserve's header: the server's pool
    pool_blocks: int | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # where the server's cache was emptied (a /reset_prefix_cache, a restart): the number of
    # records served before it
    resets: list[int] = field(default_factory=list)

    @property
    def overlapped(self) -> int:
        """Requests that arrived before an earlier one had finished (kvserve's log): concurrent
        traffic, which a sequential replay does not model."""
        count, last_end = 0, float("-inf")
        for r in self.records:
            if r.time is not None and r.time < last_end:
                count += 1
            if r.finished is not None:
                last_end = max(last_end, r.finished)
        return count

    @property
    def served_hit_rate(self) -> float | None:
        """The hit rate the server reported for these requests (kvserve's log), else None."""
        if not self.records or any(r.cached_tokens is None or r.prompt_tokens is None
                                   for r in self.records):
            return None
        total = sum(r.prompt_tokens for r in self.records)
        return sum(r.cached_tokens for r in self.records) / total if total else 0.0


def _body_of(d: dict[str, Any]) -> dict[str, Any]:
    """The request body of a line: the batch API wraps it in "body" (and may say which
    endpoint in "url"); a kvserve line or a plain body is its own."""
    body = d.get("body")
    if isinstance(body, dict) and ("messages" in body or "prompt" in body):
        return body
    return d


def parse_line(d: Any, index: int, where: str) -> list[LogRecord]:
    """The records of one JSON line (a completions body with several prompts gives several)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a request must be a JSON object")
    body = _body_of(d)
    # the namespace the server cached it in, where that was not the salt (--kv-isolation)
    salt = d["namespace"] if "namespace" in d else body.get("cache_salt")
    common = dict(cache_salt=salt, time=d.get("time", body.get("time")),
                  prompt_tokens=d.get("prompt_tokens"), cached_tokens=d.get("cached_tokens"))
    common["finished"] = d.get("finished")
    for key in ("time", "finished"):
        if common[key] is not None and not isinstance(common[key], (int, float)):
            common[key] = None
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: messages must be a non-empty list")
        return [LogRecord(index, messages=messages, tools=body.get("tools") or None,
                          chat_template_kwargs=body.get("chat_template_kwargs"),
                          add_generation_prompt=body.get("add_generation_prompt", True)
                          is not False, **common)]
    prompt = body.get("prompt", body.get("prompt_token_ids"))
    if prompt is None:
        raise ValueError(f"{where}: a request needs messages or a prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and isinstance(prompt[0], int)):
        return [LogRecord(index, prompt=prompt, **common)]
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        return [LogRecord(index + i, prompt=p, **common) for i, p in enumerate(prompt)]
    raise ValueError(f"{where}: prompt must be a string, token ids or a list of them")


def read_log(path: str | Path, limit: int | None = None) -> RequestLog:
    """Every request of a log file, in arrival order: by "time" when every record has one (a
    kvserve log is written as requests finish, and concurrent requests finish out of order),
    else in the file's order. The last header seen gives the pool size."""
    log = RequestLog([], source=str(path))
    resets: list[tuple[float | None, int]] = []  # (time, records before it)
    for lineno, d in read_jsonl(path, "request log"):
        if isinstance(d, dict) and set(d) == {"meta"} and isinstance(d["meta"], dict):
            log.meta = d["meta"]
            log.block_size = d["meta"].get("block_size", log.block_size)
            log.pool_blocks = d["meta"].get("pool_blocks", log.pool_blocks)
            if log.records:  # a server (re)started: its cache starts empty
                resets.append((d["meta"].get("started"), len(log.records)))
            continue
        if isinstance(d, dict) and d.get("event") == "reset_prefix_cache":
            resets.append((d.get("time"), len(log.records)))
            continue
        log.records += parse_line(d, len(log.records), f"{path}:{lineno}")
        if limit is not None and len(log.records) >= limit:
            break
    if not log.records:
        raise ValueError(f"request log {str(path)!r} holds no requests")
    timed = all(r.time is not None for r in log.records)
    if timed:
        log.records.sort(key=lambda r: r.time)  # stable: equal times keep the file's order
        for i, r in enumerate(log.records):
            r.index = i
    times = [r.time for r in log.records]
    for t, before in resets:
        at = bisect.bisect_right(times, t) if timed and isinstance(t, (int, float)) else before
        if 0 < at < len(log.records) and at not in log.resets:
            log.resets.append(at)
    log.resets.sort()
    return log


def request_body(record: LogRecord, max_tokens: int = 1) -> dict[str, Any]:
    """The record as an OpenAI request body again (to serve a cleaned log, or to write one)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if record.is_chat:
        body["messages"] = record.messages
        if record.tools:
            body["tools"] = record.tools
        if record.chat_template_kwargs:
            body["chat_template_kwargs"] = record.chat_template_kwargs
        if not record.add_generation_prompt:
            body["add_generation_prompt"] = False
    else:
        body["prompt"] = record.prompt
    if record.cache_salt is not None:
        body["cache_salt"] = record.cache_salt
    return body


def write_openai_log(records: list[LogRecord], path: str | Path) -> None:
    """OpenAI-format JSONL of the records' request bodies (what a cleaned log is written as)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json_line(request_body(r)) + "\n")
