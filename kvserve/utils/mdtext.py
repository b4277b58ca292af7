"""Text as Markdown inline text, for the pages generated from the code (kvserve/entrypoints/docs_ref.py)
and from the benchmarks' result records (benchmarks/lab/figures.py). A leaf module: both
generators use it without importing each other (docs_ref imports the command line, which
imports kvserve.bench)."""

from __future__ import annotations

import re


def text(s: str) -> str:
    """Help text as Markdown inline text: code spans kept as written, and outside them the
    characters that would become markup (emphasis, links, HTML, table cells) escaped."""
    parts = s.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        parts = [s.replace("`", "\\`")]
    for i in range(0, len(parts), 2):
        p = re.sub(r"([\\*\[\]|])", r"\\\1", parts[i])
        parts[i] = p.replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("\n", " ")


def code(s: str) -> str:
    """A value as a code span (safe inside a table cell)."""
    s = str(s).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"
