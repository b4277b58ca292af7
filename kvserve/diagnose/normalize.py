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
- reordered: each run of items (within a message), of whole messages, or the tool
  definitions that the classifier saw reordered, put in the log's most common order of them
  (a client would fix one order);
- whitespace: lines right-stripped, inner runs of spaces and of blank lines collapsed, each
  message stripped;
- template: the log's most common template settings (chat_template_kwargs,
  add_generation_prompt) on every chat request; in completion prompts (a client's own
  rendering), each markup variant seen replaced by the server's rendering of it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
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
    reordered_messages: set[str] = field(default_factory=set)  # messages, as JSON keys
    message_rank: dict[str, int] = field(default_factory=dict)
    tool_rank: dict[str, int] = field(default_factory=dict)  # tools seen reordered, in order
    number_contexts: set[str] = field(default_factory=set)
    template: tuple[dict | None, bool] = (None, True)
    template_subs: list[tuple[str, str]] = field(default_factory=list)  # completion prompts

    @classmethod
    def from_findings(cls, findings: list[Finding], records: list[LogRecord]) -> "FixContext":
        ctx = cls()
        tools: set[str] = set()
        for f in findings:
            if f.cls == "reordered" and f.level == "messages":
                ctx.reordered_messages.update(f.items)
            elif f.cls == "reordered" and f.level == "tools":
                tools.update(f.items)
            elif f.cls == "reordered":
                ctx.reordered_items.update(x for x in f.items if x.strip())
            elif f.cls == "template" and f.subs is not None and f.subs not in ctx.template_subs \
                    and (f.subs[1], f.subs[0]) not in ctx.template_subs:
                ctx.template_subs.append(f.subs)
            elif f.cls == "number" and f.left.strip():
                ctx.number_contexts.add(_context_key(f.left))
        ctx.item_rank = _canonical_order((split_segments(t)[0::2] for r in records
                                          for t in _texts(r)), ctx.reordered_items)
        ctx.message_rank = _canonical_order(([_key(m) for m in r.messages] for r in records
                                             if r.is_chat), ctx.reordered_messages)
        ctx.tool_rank = _canonical_order(([_key(t) for t in r.tools] for r in records
                                          if r.tools), tools)
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


def _runs(parts: list[str], items: set[str]) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive reordered items in a sequence."""
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


def _canonical_order(sequences: Iterable[list[str]], items: set[str]) -> dict[str, int]:
    """The order a reordered list is fixed to: the log's most common order of it (so the
    requests that already agree keep their prompts, and their cached blocks), items it does
    not hold after it, alphabetically."""
    if not items:
        return {}
    orders: Counter = Counter()
    for parts in sequences:
        for s, e in _runs(parts, items):
            orders[tuple(parts[s:e])] += 1
    rank: dict[str, int] = {}
    for order, _ in orders.most_common():
        for x in order:
            rank.setdefault(x, len(rank))
    for x in sorted(items - set(rank)):
        rank[x] = len(rank)
    return rank


def _key(x) -> str:
    return json.dumps(x, sort_keys=True, ensure_ascii=False)


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
    parts[0::2] = _reorder(parts[0::2], ctx.reordered_items, ctx.item_rank)
    return "".join(parts)


def _reorder(xs: list, items: set[str], rank: dict[str, int], key=lambda x: x) -> list:
    """`xs` with each run of reordered elements put in the canonical order."""
    keys = [key(x) for x in xs]
    out = list(xs)
    for k, j in _runs(keys, items):
        out[k:j] = sorted(out[k:j], key=lambda x: rank.get(key(x), len(rank)))
    return out


def _fix_reordered(ctx: "FixContext") -> Callable[[LogRecord], LogRecord]:
    """Items within messages, whole messages, and tool definitions, each put in order."""
    text_fix = _text_fix(lambda t: _sort_items(t, ctx))

    def apply(r: LogRecord) -> LogRecord:
        if r.is_chat and ctx.reordered_messages:
            r = r.copy(messages=_reorder(r.messages, ctx.reordered_messages, ctx.message_rank,
                                         _key))
        if r.tools and ctx.tool_rank:
            r = r.copy(tools=_reorder(r.tools, set(ctx.tool_rank), ctx.tool_rank, _key))
        return text_fix(r)
    return apply


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
        return _fix_reordered(ctx)
    if cls == "whitespace":
        return _text_fix(_strip_whitespace)
    if cls == "template":
        kwargs, gen = ctx.template

        def fix_template(r: LogRecord) -> LogRecord:
            if r.is_chat:
                return r.copy(chat_template_kwargs=kwargs, add_generation_prompt=gen)
            if isinstance(r.prompt, str):
                text = r.prompt
                for variant, reference in ctx.template_subs:
                    text = text.replace(variant, reference)
                return r.copy(prompt=text)
            return r
        return fix_template
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
