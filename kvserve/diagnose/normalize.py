"""The fix for each span class, applied to a logged request: what the log would have been had
the client not polluted its prompts that way.

A fix rewrites the messages (or a completion's prompt text) and leaves the rendering to the
template, as a client fixing its prompt would. Each fix touches its own class only
(patterns.masked_spans: a timestamp's digits are not a "number"), so a class is credited with
its own gain and no other's:

- timestamp, id: every match replaced by a constant (a client would move it out of the
  prefix, or drop it);
- number: numbers replaced where they follow a context the classifier saw a changing number
  after (a "Request #" counter, not the numbers of a user's question);
- reordered: each run of items that the classifier saw reordered, put in the log's most
  common order of them (a client would fix one order);
- whitespace: lines right-stripped, inner runs of spaces and of blank lines collapsed, each
  message stripped;
- template: the log's most common template settings (chat_template_kwargs,
  add_generation_prompt) on every chat request.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.diagnose.classify import Finding
from kvserve.diagnose.log import LogRecord
from kvserve.diagnose.patterns import masked_spans, split_segments

PLACEHOLDER = {"timestamp": "<timestamp>", "id": "<id>", "number": "<n>"}


@dataclass
class FixContext:
    """What the findings tell the fixes: reordered items, the contexts numbers changed after,
    the most common template settings."""

    reordered_items: set[str] = field(default_factory=set)
    item_rank: dict[str, int] = field(default_factory=dict)  # the order reordered items get
    number_contexts: set[str] = field(default_factory=set)
    template: tuple[dict | None, bool] = (None, True)

    @classmethod
    def from_findings(cls, findings: list[Finding], records: list[LogRecord]) -> "FixContext":
        ctx = cls()
        for f in findings:
            if f.cls == "reordered":
                ctx.reordered_items.update(x for x in f.items if x.strip())
            elif f.cls == "number" and f.left.strip():
                ctx.number_contexts.add(_context_key(f.left))
        ctx.item_rank = _canonical_order(records, ctx.reordered_items)
        chats = [r for r in records if r.is_chat]
        if chats:
            counts = Counter(json.dumps([r.chat_template_kwargs, r.add_generation_prompt],
                                        sort_keys=True) for r in chats)
            kwargs, gen = json.loads(counts.most_common(1)[0][0])
            ctx.template = (kwargs, gen)
        return ctx


def _texts(r: LogRecord) -> list[str]:
    if r.is_chat:
        return [m["content"] for m in r.messages if isinstance(m.get("content"), str)]
    return [r.prompt] if isinstance(r.prompt, str) else []


def _runs(text: str, items: set[str]) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive reordered items among a text's items."""
    parts = split_segments(text)[0::2]
    runs, k = [], 0
    while k < len(parts):
        if parts[k] in items:
            j = k
            while j < len(parts) and parts[j] in items:
                j += 1
            runs.append((k, j))
            k = j
        else:
            k += 1
    return runs


def _canonical_order(records: list[LogRecord], items: set[str]) -> dict[str, int]:
    """The order a reordered list is fixed to: the log's most common order of it (so the
    requests that already agree keep their prompts, and their cached blocks), items it does
    not hold after it, alphabetically."""
    if not items:
        return {}
    orders: Counter = Counter()
    for r in records:
        for text in _texts(r):
            parts = split_segments(text)[0::2]
            for s, e in _runs(text, items):
                orders[tuple(parts[s:e])] += 1
    rank: dict[str, int] = {}
    for order, _ in orders.most_common():
        for x in order:
            rank.setdefault(x, len(rank))
    for x in sorted(items - set(rank)):
        rank[x] = len(rank)
    return rank


def _context_key(left: str) -> str:
    """The last few words before a number: what identifies "the same counter" across
    requests."""
    return " ".join(left.split()[-2:])


def _replace_class(text: str, cls: str) -> str:
    out, pos = [], 0
    for m in masked_spans(text, cls):
        out += [text[pos:m.start()], PLACEHOLDER[cls]]
        pos = m.end()
    return "".join(out) + text[pos:]


def _replace_numbers(text: str, ctx: FixContext) -> str:
    if not ctx.number_contexts:
        return text
    out, pos = [], 0
    for m in masked_spans(text, "number"):
        if _context_key(text[max(0, m.start() - 24):m.start()]) in ctx.number_contexts:
            out += [text[pos:m.start()], PLACEHOLDER["number"]]
            pos = m.end()
    return "".join(out) + text[pos:]


def _sort_items(text: str, ctx: FixContext) -> str:
    """Runs of consecutive reordered items put in the canonical order (separators stay where
    they are)."""
    parts = split_segments(text)
    items = parts[0::2]
    for k, j in _runs(text, ctx.reordered_items):
        items[k:j] = sorted(items[k:j], key=lambda x: ctx.item_rank.get(x, len(ctx.item_rank)))
    parts[0::2] = items
    return "".join(parts)


_SPACES = re.compile(r"(?<=\S)[ \t]{2,}")
_BLANKS = re.compile(r"\n{3,}")


def _strip_whitespace(text: str) -> str:
    lines = [_SPACES.sub(" ", line.rstrip()) for line in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _text_fix(fix: Callable[[str], str]) -> Callable[[LogRecord], LogRecord]:
    """A fix of texts as a fix of records: every message's content, or the prompt text."""
    def apply(r: LogRecord) -> LogRecord:
        if r.is_chat:
            messages = [dict(m, content=fix(m["content"])) if isinstance(m.get("content"), str)
                        else m for m in r.messages]
            return r.copy(messages=messages)
        if isinstance(r.prompt, str):
            return r.copy(prompt=fix(r.prompt))
        return r
    return apply


def make_fix(cls: str, ctx: FixContext) -> Callable[[LogRecord], LogRecord]:
    """The fix of one class, as a function of a record."""
    if cls in ("timestamp", "id"):
        return _text_fix(lambda t: _replace_class(t, cls))
    if cls == "number":
        return _text_fix(lambda t: _replace_numbers(t, ctx))
    if cls == "reordered":
        return _text_fix(lambda t: _sort_items(t, ctx))
    if cls == "whitespace":
        return _text_fix(_strip_whitespace)
    if cls == "template":
        kwargs, gen = ctx.template
        return lambda r: r.copy(chat_template_kwargs=kwargs, add_generation_prompt=gen) \
            if r.is_chat else r
    raise ValueError(f"no fix for class {cls!r}")


def apply_fixes(records: list[LogRecord], classes: list[str],
                ctx: FixContext) -> list[LogRecord]:
    """The log with the fixes of `classes` applied, in the classifier's order."""
    fixes = [make_fix(c, ctx) for c in classes]
    out = []
    for r in records:
        for fix in fixes:
            r = fix(r)
        out.append(r)
    return out
