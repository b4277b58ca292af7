"""A request's retention from its API fields: Anthropic's `cache_control` breakpoints and
TensorRT-LLM's `kv_retention` (kv/retention.py has the rule they map onto).

A breakpoint on a chat message covers the prompt up to the end of that message as the chat
template renders it: the conversation cut after the message is rendered on its own (no
generation prompt) and its tokens' common prefix with the whole prompt's is the breakpoint's
end, so a template that adds text between messages is handled as rendered, not guessed. A
breakpoint on a content part counts as its message's end; `cache_control` at the top of a
request covers its whole prompt (Anthropic's automatic caching).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvserve.kv.prefix_index import common_prefix
from kvserve.kv.retention import (Retention, RetentionRange, cache_control_range,
                                  kv_retention_range)
from kvserve.server.protocol import APIError


def _ranges(make: Callable[[], RetentionRange], param: str) -> RetentionRange:
    try:
        return make()
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc


def message_control(message: Any) -> dict | None:
    """A chat message's breakpoint: on the message, or on one of its content parts."""
    if message.cache_control is not None:
        return message.cache_control
    if isinstance(message.content, list):
        for part in reversed(message.content):  # (a document mark is no breakpoint)
            if part.cache_control is not None and part.cache_control.get("type") != "document":
                return part.cache_control
    return None


def request_retention(req: Any, message_ends: Callable[[], Sequence[int | None]] | None = None
                      ) -> Retention | None:
    """The Retention of a completion or chat request (None: it asked for none).
    `message_ends` gives each message's end token (chat only; called only when some message
    has a breakpoint)."""
    ranges: list[RetentionRange] = []
    if req.kv_retention is not None:
        ranges.append(_ranges(lambda: kv_retention_range(req.kv_retention), "kv_retention"))
    if req.cache_control is not None:
        ranges.append(_ranges(lambda: cache_control_range(req.cache_control, None),
                              "cache_control"))
    messages = getattr(req, "messages", None) or ()
    marked = [(i, c) for i, m in enumerate(messages) if (c := message_control(m)) is not None]
    if marked:
        if len(marked) > 4:  # Anthropic's limit: four breakpoints a request
            raise APIError(400, f"at most 4 cache_control breakpoints, got {len(marked)}",
                           param="messages")
        ends = message_ends() if message_ends is not None else [None] * len(messages)
        for i, control in marked:
            ranges.append(_ranges(lambda: cache_control_range(control, ends[i]),
                                  f"messages[{i}].cache_control"))
    return Retention(tuple(ranges)) if ranges else None


def chat_message_ends(render_ids: Callable[[int], list[int]], prompt_ids: Sequence[int],
                      num_messages: int, marked: Sequence[int]) -> list[int | None]:
    """Each marked message's end in `prompt_ids`: the common prefix of the conversation cut
    after it (`render_ids(i + 1)`, no generation prompt) with the whole prompt."""
    ends: list[int | None] = [None] * num_messages
    for i in marked:
        ends[i] = common_prefix(render_ids(i + 1), prompt_ids)
    return ends
