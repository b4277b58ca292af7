"""The text patterns behind the span classes, and the segmentation reordered lists are found by.

One module so that classification (what sits at a divergence) and normalisation (the fix that
replaces it) read the same definitions: a span the classifier calls a timestamp is exactly a
span the timestamp fix replaces.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?"

# ISO 8601 / RFC 3339 dates with optional time and zone; RFC 2822 (e-mail, HTTP) dates;
# "December 2, 2026"; US and European numeric dates; clock times; Unix epoch seconds and
# milliseconds (10 and 13 digits starting with 1: 2001..2033).
TIMESTAMP = re.compile("|".join([
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2}|"
    r" ?UTC| ?GMT)?",
    rf"(?:{_DAY} )?\d{{1,2}} {_MONTH} \d{{4}}(?: \d{{2}}:\d{{2}}(?::\d{{2}})?)?"
    r"(?: [+-]\d{4}| GMT| UTC)?",
    rf"(?:{_DAY} )?{_MONTH} \d{{1,2}},? \d{{4}}(?:,? \d{{1,2}}:\d{{2}}(?::\d{{2}})?"
    r"(?: ?[AaPp]\.?[Mm]\.?)?)?",
    r"\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b(?: \d{1,2}:\d{2}(?::\d{2})?)?",
    r"\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?: ?[AaPp]\.?[Mm]\.?)?(?: ?UTC| ?GMT)?",
    r"\b1\d{9}(?:\d{3}|\.\d+)?\b",
]))

# UUIDs (any version, any case), and hex ids of 12+ digits with letters and digits both (so
# that neither a word nor a plain number is one): request ids, hashes, trace ids.
IDENTIFIER = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{12,}\b"
    r"|\b(?=[A-Za-z0-9]*\d)(?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z])[A-Za-z0-9]{20,}\b")

NUMBER = re.compile(r"\d+(?:\.\d+)?")

# What separates the items of a list in a prompt: blank lines, and the chat template's markup
# tokens (<|im_start|>, <|eot_id|>, ...), so that the last item of a list is not glued to the
# end of its message.
_MARKUP = r"<\|[^|<>\s]{1,40}\|>|</?s>|\[/?INST\]"
SEPARATOR = re.compile(rf"(\n[ \t]*\n\s*|{_MARKUP})")
MARKUP = re.compile(_MARKUP)  # a chat template's special tokens

PATTERNS = {"timestamp": TIMESTAMP, "id": IDENTIFIER, "number": NUMBER}


def covering(pattern: re.Pattern, text: str, pos: int, reach: int = 96) -> re.Match | None:
    """The match of `pattern` that covers character `pos` (or ends right at it), searched in
    a window around it."""
    lo = max(0, pos - reach)
    for m in pattern.finditer(text, lo, min(len(text), pos + reach)):
        if m.start() > pos:
            break
        if m.start() <= pos < m.end() or (m.end() == pos and m.end() > m.start()):
            return m
    return None


def masked_spans(text: str, cls: str) -> Iterator[re.Match]:
    """The matches of class `cls` in `text` that no earlier class claims (a number inside a
    timestamp is the timestamp's, a timestamp's digits are not an id): each span belongs to
    one class, so no fix is credited with another's gain."""
    order = list(PATTERNS)
    earlier = order[: order.index(cls)]
    taken = [(m.start(), m.end()) for c in earlier for m in PATTERNS[c].finditer(text)]
    for m in PATTERNS[cls].finditer(text):
        if not any(s < m.end() and m.start() < e for s, e in taken):
            yield m


def split_segments(text: str) -> list[str]:
    """`text` as [item, separator, item, separator, ..., item]: items at even positions."""
    return SEPARATOR.split(text)
