"""Real English and code text found on the machine, as windows of one document each: what the
accuracy benchmarks (benchmarks/bench_kv_quant.py, benchmarks/bench_bounded_kv.py) score a real
model on, where the stdlib split (kvserve.eval.heldout) was made for a model trained on it.

English: the license texts a Debian-like system ships under /usr/share/common-licenses, the
running Python's LICENSE.txt (its history and licenses), and the long descriptions (README
text, Markdown or reST with some code) in the METADATA of packages installed with kvserve
(pinned by constraints.txt), taken alternately: a license, then a package's description.
Code: the stdlib's held-out split (`heldout.stdlib_files("heldout")`), in its corpus order.
A source that is absent is skipped; the benchmarks print the documents they used.

Windows: each document's tokens (no special tokens) cut into non-overlapping windows of
`context` tokens, a shorter tail dropped, so no window crosses a document boundary (a long-
context figure needs one text that long); the windows are taken round-robin, every document's
first window before any second one, so a few windows still span many documents.
"""

from __future__ import annotations

import importlib.metadata
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvserve.eval.heldout import stdlib_files, stdlib_root
from kvserve.eval.perplexity import read_text
from kvserve.tokenizer.tokenizer import Tokenizer

Kind = Literal["english", "code"]
KINDS: tuple[Kind, ...] = ("english", "code")

LICENSES_DIR = Path("/usr/share/common-licenses")
# Distinct texts only (GPL-2 and LGPL-2 share most of GPL-3's and LGPL-2.1's words).
LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")
# Packages whose METADATA carries a long English description (installed with kvserve's
# test dependencies; versions from constraints.txt).
PACKAGE_DESCRIPTIONS = ("tqdm", "tabulate", "regex", "more-itertools", "openai", "lm_eval",
                        "torch", "transformers", "sacrebleu", "pydantic")


@dataclass(frozen=True)
class Document:
    name: str  # what the benchmarks print: a path, or a package's name and version
    text: str


def _license_documents() -> Iterator[Document]:
    for name in LICENSES:
        path = LICENSES_DIR / name
        if path.is_file():
            yield Document(str(path), read_text(path))
    python_license = stdlib_root() / "LICENSE.txt"
    if python_license.is_file():
        yield Document(str(python_license), read_text(python_license))


def _package_documents() -> Iterator[Document]:
    for name in PACKAGE_DESCRIPTIONS:
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        body = meta.get_payload() or meta.get("Description") or ""
        if body.strip():
            yield Document(f"{meta['Name']} {meta['Version']} METADATA description", body)


def documents(kind: Kind) -> list[Document]:
    """The corpus's documents in order (English: a license and a package description in
    turn, the rest of the longer list after)."""
    if kind == "code":
        root = stdlib_root()
        return [Document(str(p.relative_to(root)), read_text(p))
                for p in stdlib_files("heldout", root)]
    if kind != "english":
        raise ValueError(f"unknown corpus {kind!r}: one of {KINDS}")
    pairs = itertools.zip_longest(_license_documents(), _package_documents())
    return [d for pair in pairs for d in pair if d is not None]


@dataclass(frozen=True)
class Window:
    document: str
    index: int  # which window of its document (0: its first `context` tokens)
    tokens: list[int]


def document_windows(tokenizer: Tokenizer, docs: Sequence[Document], context: int,
                     count: int) -> list[Window]:
    """Up to `count` windows of exactly `context` tokens, round-robin over the documents."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    per_doc = []
    for doc in docs:
        ids = tokenizer.encode(doc.text, add_special_tokens=False)
        cut = [Window(doc.name, i, ids[i * context:(i + 1) * context])
               for i in range(len(ids) // context)]
        if cut:
            per_doc.append(cut)
    rounds = itertools.zip_longest(*per_doc)
    return list(itertools.islice((w for r in rounds for w in r if w is not None), count))


def describe(windows: Sequence[Window]) -> str:
    """One line per document used: its name and which of its windows."""
    used: dict[str, list[int]] = {}
    for w in windows:
        used.setdefault(w.document, []).append(w.index)
    return "\n".join(f"  {name}: window{'s' if len(ix) > 1 else ''} "
                     f"{', '.join(str(i) for i in ix)}" for name, ix in used.items())
