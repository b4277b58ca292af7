"""Reading JSON Lines files (traces, request logs): one object per non-blank line.

Why one reader: every JSONL input kvserve takes (a simulator trace, a server's request log)
should refuse a missing file and a bad line the same way, naming the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
