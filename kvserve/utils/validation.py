"""Per-request checks shared by the engine, SamplingParams and the server.

A request is validated once, before it is queued, so that nothing it carries can fail later
inside a batched step (where one bad request would take its neighbours down with it): text must
encode to UTF-8 (the block hashes and the tokenizer encode it), token ids must be in the
vocabulary, and a prompt whose text alone proves it is too long is refused before it is
tokenized. Error messages never echo a caller's value in full (`shorten`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

ECHO_LIMIT = 100  # characters of a caller's value an error message repeats
MAX_CACHE_SALT_CHARS = 256

# What one request may cost the server (the `kvserve serve` flags of the same names). Here, not
# in the server, so that the CLI's parser has them without importing torch.
DEFAULT_MAX_WAITING_REQUESTS = 1024  # sequences (prompts x n) waiting for a slot
DEFAULT_MAX_SEQS_PER_REQUEST = 1024  # sequences one request may ask for
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024**2  # room for a max_model_len prompt of any model


def json_object(source: Any, what: str) -> dict:
    """A config given as JSON text (a CLI flag's value) or as a dict, as the dict; anything
    else is a ValueError naming `what` (`--kv-transfer-config`, `--speculative-config`)."""
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(source, dict):
        raise ValueError(f"{what} must be a JSON object (a dict), got {type(source).__name__}")
    return source


def shorten(value: object, limit: int = ECHO_LIMIT) -> str:
    """`value` as an error message may show it: its repr cut to `limit` characters (a 5 MB
    model name must not come back whole), with lone surrogates escaped so that the message
    itself always encodes."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_utf8(name: str, text: str) -> None:
    """Refuse a string that cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800",
    which JSON escapes and Python strings allow): it would fail in the tokenizer or the block
    hash, inside a step shared with other requests."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: it contains a lone surrogate "
                         f"{text[exc.start]!r} at position {exc.start}") from None


def check_cache_salt(salt: object) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most "
                         f"{MAX_CACHE_SALT_CHARS} characters, got {shorten(salt, 40)}")
    check_utf8("cache_salt", salt)


def check_token_ids(name: str, ids: list, vocab_size: int) -> None:
    """Every id an integer in [0, vocab_size): an id past the vocabulary would index past the
    embedding or the logits inside the step."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} {shorten(bad[:5])} are outside the vocabulary "
                         f"[0, {vocab_size})")


class _Bounded(Protocol):
    def min_num_tokens(self, text: str) -> int: ...


def check_text_fits(tokenizer: _Bounded, text: str, max_model_len: int,
                    what: str = "the prompt") -> None:
    """Refuse a text that cannot fit in max_model_len tokens without tokenizing it: tokenizing
    20 MB costs seconds of CPU and a token list of hundreds of MB, only to refuse it."""
    least = tokenizer.min_num_tokens(text)
    if least >= max_model_len:
        raise ValueError(f"{what} has {len(text):,} characters, so at least {least:,} tokens, "
                         f"but max_model_len is {max_model_len}: no room to generate")
