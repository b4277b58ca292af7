"""JSON one object per line: reading JSON Lines files (traces, request logs), and writing a
line that stays one line (those files, server-sent events).

Why one reader: every JSONL input kvserve takes (a simulator trace, a server's request log)
should refuse a missing file and a bad line the same way, naming the file and the line.
Why one writer: JSON leaves NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR raw, and a reader that
splits on Unicode line boundaries (Python's str.splitlines, httpx's aiter_lines) cuts such a
line in two; a sampled token or a prompt may hold any of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The characters str.splitlines() ends a line at that JSON leaves raw (NEL, U+2028, U+2029).
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                "\u2029": "\\u2029"})


def json_line(obj: Any) -> str:
    """`obj` as compact JSON on one line for every line splitter (no newline at the end)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)


def read_jsonl(path: str | Path, what: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; ValueError naming `what` and the
    path if the file is missing, and the line if it is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
