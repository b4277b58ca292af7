"""A prompt given as parts, some marked as reusable documents, into token ids and spans.

The shape is the chat API's text content part, so one request body reads the same in chat,
completions and Python:

    {"prompt_parts": ["You answer from the passages.\n",
                      {"text": passage, "cache_control": {"type": "document"}},
                      {"type": "text", "text": "Question: ..."}]}

With token ids, the spans are given as they are: `{"prompt_token_ids": [...], "documents":
[[start, end], ...]}` (token positions, end exclusive).

Each part is tokenized on its own and the ids concatenated (the first part with the
tokenizer's special tokens, a BOS where it adds one). Why not the joined text: a document's
KV is stored under the hash of its tokens, so its tokens must be the same wherever it sits;
tokenizing the joined text would let a BPE merge across a part boundary change them. A part
boundary is a token boundary, as LMCache's blending also assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.utils.validation import check_utf8

DOCUMENT = "document"


@dataclass(frozen=True)
class PromptParts:
    text: str
    token_ids: list[int]
    documents: tuple[tuple[int, int], ...]  # [start, end) token spans of marked parts


def is_document(part: Mapping[str, Any]) -> bool:
    """Whether a part carries `"cache_control": {"type": "document"}`."""
    control = part.get("cache_control")
    return isinstance(control, Mapping) and control.get("type") == DOCUMENT


def part_text(part: Any, where: str) -> tuple[str, bool]:
    """A part's text and whether it is a document; a clear ValueError for anything else."""
    if isinstance(part, str):
        return part, False
    if not isinstance(part, Mapping):
        raise ValueError(f"{where} must be a string or an object with 'text', "
                         f"got {type(part).__name__}")
    if part.get("type", "text") != "text":
        raise ValueError(f"{where}: only text parts can be prompt parts, got type "
                         f"{part.get('type')!r}")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where} needs a string 'text'")
    control = part.get("cache_control")
    if control is not None and not (isinstance(control, Mapping)
                                    and control.get("type") in (DOCUMENT, "ephemeral")):
        raise ValueError(f"{where}: cache_control must be {{'type': 'document'}} (or "
                         f"Anthropic's 'ephemeral'), got {control!r}")
    return text, is_document(part)


def tokenize_parts(tokenizer, parts: Sequence[Any],
                   check: Callable[[str], None] | None = None) -> PromptParts:
    """Token ids of the parts, each tokenized alone, and the spans of the document parts;
    `check` sees the whole text before any tokenizing (a prompt too long to fit)."""
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise ValueError("prompt_parts must be a non-empty list of parts")
    read = [part_text(part, f"prompt_parts[{i}]") for i, part in enumerate(parts)]
    for i, (text, _) in enumerate(read):
        check_utf8(f"prompt_parts[{i}]", text)
    whole = "".join(text for text, _ in read)
    if check is not None:
        check(whole)
    ids: list[int] = []
    documents: list[tuple[int, int]] = []
    first = True
    for text, document in read:
        tokens = tokenizer.encode(text, add_special_tokens=first) if text else []
        first = False
        if document and tokens:
            documents.append((len(ids), len(ids) + len(tokens)))
        ids.extend(tokens)
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    return PromptParts(whole, ids, tuple(documents))


def check_spans(spans: Any, num_tokens: int) -> tuple[tuple[int, int], ...]:
    """`documents` of a token-ids prompt: sorted, disjoint [start, end) spans inside it."""
    if not isinstance(spans, Sequence) or isinstance(spans, (str, bytes)):
        raise ValueError("documents must be a list of [start, end] token spans")
    out: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        if not isinstance(span, Sequence) or len(span) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in span):
            raise ValueError(f"documents[{i}] must be [start, end] (two integers)")
        start, end = span
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"documents[{i}] = [{start}, {end}] is not a non-empty span of "
                             f"the prompt's {num_tokens} tokens")
        if out and start < out[-1][1]:
            raise ValueError(f"documents[{i}] starts before documents[{i - 1}] ends: spans "
                             "must be sorted and must not overlap")
        out.append((start, end))
    return tuple(out)
