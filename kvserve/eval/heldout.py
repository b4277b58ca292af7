"""The held-out split of the running Python's standard library, the corpus that perplexity is
reported on and that a model trained on the stdlib must not see.

The rule is stated so that any other tool can reproduce it without importing kvserve: a file
is held out when the SHA-256 of its path relative to the stdlib root (POSIX separators, UTF-8),
read as a big-endian integer from its first 8 bytes (that is, `int(hexdigest[:16], 16)`), is
below 50 modulo 1,000 (about 5% of the files). scripts/train_model.py trains on the other side
of this same split. Only `*.py` files count, and none under a
`site-packages`, `test` or `tests` directory (installed packages are not the stdlib, and the
test suites are mostly generated-looking data). Hashing the path, not the content, keeps a file
on the same side of the split across Python patch releases.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Literal

HELD_OUT_PER_MILLE = 50
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests"})

Split = Literal["train", "heldout"]


def stdlib_root() -> Path:
    """The standard library directory of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """Whether a stdlib file (its POSIX path relative to the stdlib root) is held out."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


def corpus_files(root: Path | None = None) -> list[str]:
    """POSIX paths, relative to the stdlib root, of every corpus file (both splits), sorted so
    that every run reads them in one order."""
    root = root or stdlib_root()
    chosen = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        chosen.append(rel.as_posix())
    return sorted(chosen)


def stdlib_files(split: Split, root: Path | None = None) -> list[Path]:
    """The split's files, in corpus order."""
    root = root or stdlib_root()
    return [root / rel for rel in corpus_files(root) if is_heldout(rel) == (split == "heldout")]
