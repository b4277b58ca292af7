"""kvserve's log format: one handler on the `kvserve` logger, as vLLM does, unless the
application configured the logger itself; and uvicorn's handlers in the same one-line form.

One record, one line. A log message carries what callers send (a request's `user`, a model
name, a URL path, a peer's address), and a caller who can put a newline (or a carriage return,
NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR, or a terminal escape) in one could write a line of its
own that reads as the server's ("ERROR 12-07 ... forged"). Escaping at each call site would be
forgotten at the next one, so the formatter does it once, for every record: the message after
%-formatting has its control characters written as escapes. A traceback (`exc_info`) keeps its
lines, which are ours (frames, source lines), and is read as one block after the record's line;
only its exception messages are escaped, since an exception may quote what a caller sent.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from typing import Any

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
# C0 and C1 controls (newline, carriage return, NEL, ESC...), DEL, and the two Unicode line
# breaks str.splitlines() and many log viewers honour.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """`text` with every control character and line break escaped (`\\n`, `\\x85`,
    `\\u2028`...): what a log line may hold of a caller's string."""
    return _CONTROLS.sub(_escape, text)


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _traceback_lines(te: traceback.TracebackException) -> list[str]:
    """Python's traceback of `te` (its chain first), each exception's message on one line."""
    lines: list[str] = []
    if te.__cause__ is not None:
        lines += _traceback_lines(te.__cause__) + [_CAUSE]
    elif te.__context__ is not None and not te.__suppress_context__:
        lines += _traceback_lines(te.__context__) + [_CONTEXT]
    if te.stack:
        lines += ["Traceback (most recent call last):\n", *te.stack.format()]
    return lines + [one_line(part.rstrip("\n")) + "\n" for part in te.format_exception_only()]


class OneLineMixin:
    """Escapes the record's message before the formatter lays out its line, and the exception
    messages of its traceback (a mixin, so that uvicorn's formatters, with their colours, keep
    their own layout)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)  # type: ignore[misc]

    def formatException(self, ei: Any) -> str:
        te = traceback.TracebackException(*ei, compact=True)
        return "".join(_traceback_lines(te)).rstrip("\n")


class OneLineFormatter(OneLineMixin, logging.Formatter):
    """kvserve's formatter: one record, one line (tracebacks excepted)."""


def uvicorn_formatter(fmt: str | None = None, datefmt: str | None = None,
                      use_colors: bool | None = None, access: bool = False) -> logging.Formatter:
    """uvicorn's DefaultFormatter (or AccessFormatter) with the message escaped: the factory
    `uvicorn_log_config` names, imported only where uvicorn runs."""
    from uvicorn.logging import AccessFormatter, DefaultFormatter

    base = AccessFormatter if access else DefaultFormatter
    cls = type("OneLine" + base.__name__, (OneLineMixin, base), {})
    return cls(fmt, datefmt, use_colors=use_colors)


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config, its formatters swapped for the one-line ones (uvicorn
    logs an invalid request, and with its access log a request line, a caller's bytes)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name, formatter in config["formatters"].items():
        formatter["()"] = "kvserve.utils.logging_setup.uvicorn_formatter"
        formatter["access"] = name == "access"
    return config


def init_logging() -> None:
    logger = logging.getLogger("kvserve")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("KVSERVE_LOGGING_LEVEL", "INFO"))
    logger.propagate = False
