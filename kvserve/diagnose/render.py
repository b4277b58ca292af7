"""Logged requests to the prompt text and token ids the server would compute: the chat template
and tokenizer the server uses (`kvserve.server.chat_prompt.render_chat`), so that what diagnose
replays is what the prefix cache saw.

Why render rather than read token ids from the log: the fixes diagnose measures change the
messages (a timestamp replaced, examples sorted), and each changed request must be rendered
again exactly as the server would render it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.diagnose.log import LogRecord


@dataclass
class Rendered:
    """A request as the cache sees it: the prompt text (None for a token-id prompt), its
    tokens, and the cache salt that keys its blocks."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None


def load_tokenizer(model: str | None):
    """The tokenizer (with its chat template) of a model directory or GGUF file; None, or the
    default model's name, is the model `kvserve serve` runs when given none."""
    from kvserve.router.launch import load_tokenizer as load

    return load(model if model is not None else "default")


def _chat_request(record: LogRecord):
    """The record as the server's validated request type (only the fields rendering reads, so
    that a log from another server with fields kvserve does not implement still renders)."""
    from kvserve.server.protocol import ChatCompletionRequest

    body: dict[str, Any] = {"messages": record.messages,
                            "add_generation_prompt": record.add_generation_prompt}
    if record.tools:
        body["tools"] = record.tools
    if record.chat_template_kwargs:
        body["chat_template_kwargs"] = record.chat_template_kwargs
    return ChatCompletionRequest.model_validate(body)


def render_text(tokenizer, record: LogRecord) -> str | None:
    """The prompt text of a record (None when it came as token ids)."""
    if record.is_chat:
        from kvserve.server.chat_prompt import render_chat

        return render_chat(tokenizer, _chat_request(record))
    return record.prompt if isinstance(record.prompt, str) else None


def render(tokenizer, record: LogRecord) -> Rendered:
    """Text and tokens as the server makes them: a chat prompt is encoded without special
    tokens (the template has its own), a completion prompt with them."""
    text = render_text(tokenizer, record)
    if text is None:
        return Rendered(None, list(record.prompt), record.cache_salt)  # type: ignore[arg-type]
    ids = tokenizer.encode(text, add_special_tokens=not record.is_chat)
    return Rendered(text, ids, record.cache_salt)


def render_all(tokenizer, records: list[LogRecord],
               memo: dict[str, Rendered] | None = None) -> list[Rendered]:
    """Every record rendered, each distinct request once (a log repeats many; pass one `memo`
    to the renderings of a log and its fixed versions, which share most requests)."""
    import json

    memo = {} if memo is None else memo
    out = []
    for r in records:
        key = json.dumps([r.messages, r.prompt, r.tools, r.chat_template_kwargs,
                          r.add_generation_prompt, r.cache_salt], sort_keys=True)
        got = memo.get(key)
        if got is None:
            got = memo[key] = render(tokenizer, r)
        out.append(got)
    return out
