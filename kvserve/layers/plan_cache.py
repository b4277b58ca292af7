"""The one reader and writer of the measured kernel choices cached on disk (issue 65): JSON
files under $KVSERVE_CACHE_DIR, one entry per key (the CPU, its flags, torch, threads and the
shapes measured), used by the float GEMM plan (gemm_select: "gemm-choice.json") and by the
quantized projections' crossovers (kernel_choice: "qgemm-rows.json").

Why one: the two caches were written by near-copies of the same read-merge-replace code;
a fix to one (a torn write, a read-only directory) then missed the other.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kvserve.utils.paths import cache_dir

logger = logging.getLogger("kvserve")


def path_of(name: str) -> Path:
    """The cache file `name` (e.g. "gemm-choice.json") under $KVSERVE_CACHE_DIR."""
    return cache_dir() / name


def read(name: str, key: str) -> Any:
    """The entry cached under `key` in file `name`; None where the file, or the key, is
    missing or unreadable (a miss costs a measurement, never an error)."""
    try:
        data = json.loads(path_of(name).read_text())
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def write(name: str, key: str, entry: Any) -> None:
    """Set `key`'s entry in file `name`, keeping the other keys. Replaced whole through a
    temporary file (a reader never sees half a file); best effort: a read-only cache
    directory only costs a measurement next time."""
    path = path_of(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        data[key] = entry
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not cache a kernel choice in %s: %s", path, e)
