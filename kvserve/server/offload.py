"""Request text sizes, and running a request's tokenizing off the event loop when it is big."""

from __future__ import annotations

import asyncio

# Text longer than this is rendered and tokenized in a worker thread, keeping the event loop
# (and /health) responsive; shorter text costs less than the thread hop.
_TOKENIZE_INLINE_CHARS = 8192


def text_size(value) -> int:
    """Characters of text in a prompt or message contents (token ids count one each)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        if value and isinstance(value[0], int):  # token ids: no walk over 100k items
            return len(value)
        return sum(map(text_size, value)) + len(value)
    return len(getattr(value, "text", "") or "")


async def off_loop(size: int, fn, *args):
    """`fn(*args)` in a worker thread when the input is large (rendering and tokenizing 1 MB
    holds the event loop for long), inline when it is small (the thread hop costs more)."""
    if size > _TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
