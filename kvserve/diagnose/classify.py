"""What sits where a request diverges from its nearest earlier one: a span class, or plain content.

The test that separates pollution from content: a polluting span is a local difference after
which the two prompts agree again (a timestamp, then the same instructions; two examples swapped,
then the same question format), while content (a different user question) differs to the end.
So each class is a pattern at the divergence point in both prompts, followed by `AGREE` equal
characters (or both prompts' end). The classes, in the order they are tried:

- reordered: the same items in another order: tool definitions (`tools`, when the template
  renders them), whole messages (few-shot turns, documents sent as messages), or items of a
  message (what blank lines and template markup separate: examples, documents);
- timestamp: dates, times, epoch stamps (patterns.TIMESTAMP);
- id: UUIDs and hex ids;
- number: any other number that changes per request;
- whitespace: the prompts differ only in a run of whitespace there (trailing spaces, blank
  lines);
- template: the same messages rendered differently: chat requests whose messages agree but whose
  rendering differs in the template's markup (chat_template_kwargs, add_generation_prompt), or
  prompt texts that differ only in markup (a client rendering its own template for
  /v1/completions) and agree again after it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from kvserve.diagnose.divergence import Divergence, common_prefix
from kvserve.diagnose.log import LogRecord
from kvserve.diagnose.patterns import MARKUP, PATTERNS, covering, split_segments

AGREE = 12  # characters that must agree after a span for it to be a local difference
MAX_ITEMS = 64  # longest run of items a reordering is looked for in

CLASSES = ("timestamp", "id", "number", "reordered", "whitespace", "template")
LABELS = {"timestamp": "timestamps and dates", "id": "UUIDs and hex ids",
          "number": "numbers changing per request", "reordered": "reordered lists",
          "whitespace": "whitespace drift", "template": "template drift"}


@dataclass
class Finding:
    """One request's divergence, classified. `span` and `other_span` are the differing text
    in this request and in its nearest earlier one; `items` (reordered) the items involved."""

    index: int
    other: int
    cls: str  # one of CLASSES, or "content" / "extension" / "first" / "repeat"
    char: int
    token: int
    span: str = ""
    other_span: str = ""
    items: tuple[str, ...] = field(default=())
    left: str = ""  # text just before the span (numbers: the fix replaces numbers after it)
    subs: tuple[str, str] | None = None  # template drift in text: (variant, the reference)
    level: str = "text"  # reordered: what was reordered (text items, messages or tools)

    @property
    def is_pollution(self) -> bool:
        return self.cls in CLASSES


def _describe(key: str) -> str:
    """A reordered message or tool, shown by its content or name."""
    x = json.loads(key)
    if isinstance(x, dict):
        fn = x.get("function")
        if isinstance(fn, dict) and "name" in fn:
            return f"tool {fn['name']}"
        if isinstance(x.get("content"), str):
            return f"{x.get('role', '?')}: {x['content']}"
    return key


def _agree_after(a: str, ea: int, b: str, eb: int) -> bool:
    """The prompts agree for AGREE characters after the spans (or both end within them)."""
    ta, tb = a[ea:ea + AGREE], b[eb:eb + AGREE]
    if len(ta) < AGREE or len(tb) < AGREE:
        n = min(len(ta), len(tb))
        return ta[:n] == tb[:n] and (n > 0 or (not ta and not tb))
    return ta == tb


def _pattern_span(cls: str, a: str, b: str, d: int) -> tuple[str, str, int] | None:
    """(span in a, span in b, start) when a match of `cls` covers the divergence in both and
    the prompts agree after them."""
    pat = PATTERNS[cls]
    ma, mb = covering(pat, a, d), covering(pat, b, d)
    if ma is None or mb is None or ma.start() != mb.start():
        return None
    if ma.group() == mb.group() or not _agree_after(a, ma.end(), b, mb.end()):
        return None
    return ma.group(), mb.group(), ma.start()


def _whitespace_span(a: str, b: str, d: int) -> tuple[str, str] | None:
    """The two whitespace runs around the divergence, when they are all that differs."""
    s = d
    while s > 0 and a[s - 1].isspace():
        s -= 1
    ea, eb = s, s
    while ea < len(a) and a[ea].isspace():
        ea += 1
    while eb < len(b) and b[eb].isspace():
        eb += 1
    if a[s:ea] == b[s:eb]:
        return None
    if not (ea > d or eb > d):
        return None  # neither has whitespace at the divergence
    if not _agree_after(a, ea, b, eb):
        return None
    return a[s:ea], b[s:eb]


def _reordered_items(a: str, b: str, d: int) -> tuple[str, ...] | None:
    """The items of the shortest run, starting where the prompts diverge, that holds the same
    items in both in another order (None when there is none)."""
    sa, sb = split_segments(a), split_segments(b)
    ia, ib = sa[0::2], sb[0::2]
    p = 0
    while p < min(len(ia), len(ib)) and ia[p] == ib[p] and sa[2 * p + 1:2 * p + 2] == \
            sb[2 * p + 1:2 * p + 2]:
        p += 1
    diff: Counter = Counter()
    for k in range(p, min(len(ia), len(ib), p + MAX_ITEMS)):
        diff[ia[k]] += 1
        diff[ib[k]] -= 1
        if not any(diff.values()) and k > p:
            if ia[p:k + 1] == ib[p:k + 1]:
                return None
            return tuple(ia[p:k + 1])
    return None


def _key(x) -> str:
    return json.dumps(x, sort_keys=True, ensure_ascii=False)


def _permuted_run(xs: list, ys: list) -> tuple[int, tuple[str, ...]] | None:
    """(start, keys) of the shortest run from the first difference that holds the same
    elements in both lists in another order."""
    kx, ky = [_key(x) for x in xs], [_key(y) for y in ys]
    p = common_prefix(kx, ky)
    diff: Counter = Counter()
    for k in range(p, min(len(kx), len(ky), p + MAX_ITEMS)):
        diff[kx[k]] += 1
        diff[ky[k]] -= 1
        if k > p and not any(diff.values()):
            return p, tuple(kx[p:k + 1])
    return None


def _message_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Where each message's content sits in the rendered prompt (-1 when not found)."""
    spans, pos = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        at = text.find(content, pos) if content else -1
        spans.append((at, at + len(content)) if at >= 0 else (-1, -1))
        if at >= 0:
            pos = at + len(content)
    return spans


def _message_at(a: str, ra: LogRecord, d: int) -> tuple[int, bool]:
    """(index of the message at or after character d, whether d is inside its content)."""
    spans = _message_spans(a, ra.messages)
    for k, (s, e) in enumerate(spans):
        if s <= d < e:
            return k, True
        if s > d:
            return k, False
    return len(spans), False


def _reordered_messages(a: str, ra: LogRecord, rb: LogRecord, d: int) -> tuple[str, ...] | None:
    """Whole messages reordered (few-shot turns, documents sent as messages), the run starting
    at the message where the prompts diverge."""
    if not (ra.is_chat and rb.is_chat):
        return None
    got = _permuted_run(ra.messages, rb.messages)
    if got is None:
        return None
    start, keys = got
    k, _ = _message_at(a, ra, d)
    return keys if start <= k <= start + len(keys) else None


def _reordered_tools(a: str, ra: LogRecord, rb: LogRecord, d: int) -> tuple[str, ...] | None:
    """The same tool definitions in another order, where the template renders them before the
    messages the two requests share."""
    if not (ra.tools and rb.tools) or ra.tools == rb.tools:
        return None
    if Counter(map(_key, ra.tools)) != Counter(map(_key, rb.tools)):
        return None
    k, _ = _message_at(a, ra, d)
    if not (ra.is_chat and rb.is_chat) or ra.messages[:k + 1] != rb.messages[:k + 1]:
        return None
    return tuple(_key(t) for t in ra.tools)


MARKUP_REACH = 256  # longest markup difference looked for (a default system message)
HEADER_CHANGE = 24  # longest change in a header line (a role name) without a special token


def _realign(a: str, b: str, d: int, reach: int) -> tuple[int, int] | None:
    """The shortest skips (i in a, j in b) after which the prompts agree for AGREE characters
    again."""
    best = None
    for i in range(reach + 1):
        probe = a[d + i:d + i + AGREE]
        if len(probe) < AGREE or (best is not None and i >= sum(best)):
            break
        j = b.find(probe, d, d + reach + AGREE)
        if j >= 0 and (best is None or i + j - d < sum(best)):
            best = (i, j - d)
    return best


def _markup_drift(a: str, b: str, d: int) -> tuple[str, str] | None:
    """Two renderings of the same conversation that differ in the template's markup (a client
    rendering its own template for /v1/completions: another role header, a missing default
    system message): the divergence is in a markup header (after a special token, before the
    end of its line) or the differing spans hold a special token, and the prompts agree again
    within MARKUP_REACH characters. The spans returned run from that special token to the
    realignment, plus the AGREE characters both share, so that replacing one by the other is
    specific."""
    got = _realign(a, b, d, MARKUP_REACH)
    if got is None:
        return None
    i, j = got
    last = None
    for m in MARKUP.finditer(a, max(0, d - 64), d):
        last = m
    in_header = last is not None and "\n" not in a[last.end():d]
    inside = MARKUP.search(a, d, d + i) or MARKUP.search(b, d, d + j)
    if not (inside or (in_header and max(i, j) <= HEADER_CHANGE)):
        return None  # (a long change after a header is content: "[INST] question")
    s = last.start() if in_header else d
    return a[s:d + i + AGREE], b[s:d + j + AGREE]


def _is_template_drift(a: str, ra: LogRecord, rb: LogRecord, d: int) -> bool:
    """The divergence is in markup, not in a message, and the messages so far are equal."""
    if not (ra.is_chat and rb.is_chat):
        return False
    spans = _message_spans(a, ra.messages)
    upto = 0
    for k, (s, e) in enumerate(spans):
        if s <= d < e:
            return False  # inside a message's content
        if s > d or s < 0:
            break
        upto = k + 1
    upto = min(upto + 1, len(ra.messages))
    return ra.messages[:upto] == rb.messages[:upto]


def classify(div: Divergence, a: str | None, b: str | None, ra: LogRecord,
             rb: LogRecord | None) -> Finding:
    """The class of one request's divergence from its nearest earlier request."""
    f = Finding(div.index, div.other, "content", div.char, div.token)
    if div.other < 0:
        f.cls = "first"
        return f
    if div.identical or (a is not None and a == b):
        f.cls = "repeat"
        return f
    if a is None or b is None:
        return f  # token ids: nothing to read
    d = div.char
    if d >= len(a) or d >= len(b):
        f.cls = "extension"  # one prompt continues the other (a conversation's next turn)
        return f
    if rb is not None:
        for level, find in (("tools", _reordered_tools), ("messages", _reordered_messages)):
            keys = find(a, ra, rb, d)
            if keys is not None:
                f.cls, f.items, f.level = "reordered", keys, level
                f.span, f.other_span = _describe(keys[0]), _describe(
                    next((x for x in keys if x != keys[0]), keys[0]))
                return f
    items = _reordered_items(a, b, d)
    if items is not None:
        f.cls, f.items = "reordered", items
        f.span, f.other_span = items[0], next(x for x in items if x != items[0]) \
            if len(set(items)) > 1 else items[0]
        return f
    for cls in PATTERNS:
        got = _pattern_span(cls, a, b, d)
        if got is not None:
            f.cls, f.span, f.other_span = cls, got[0], got[1]
            f.left = a[max(0, got[2] - 24):got[2]]
            return f
    ws = _whitespace_span(a, b, d)
    if ws is not None:
        f.cls, f.span, f.other_span = "whitespace", ws[0], ws[1]
        return f
    if rb is not None and _is_template_drift(a, ra, rb, d):
        f.cls, f.span, f.other_span = "template", a[d:d + 24], b[d:d + 24]
        return f
    markup = _markup_drift(a, b, d)
    if markup is not None:
        f.cls, f.span, f.other_span = "template", markup[0], markup[1]
        # the fix rewrites a client's own rendering (a completion prompt) to the server's, the
        # reference, or (two completion prompts) to the earlier request's
        chat_is_this = ra.is_chat and rb is not None and not rb.is_chat
        f.subs = (markup[1], markup[0]) if chat_is_this else (markup[0], markup[1])
    return f
