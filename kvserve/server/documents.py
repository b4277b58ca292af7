"""Reusable documents in API requests (kvserve/blend/): a text content part carrying
`"cache_control": {"type": "document"}` marks its text as a document.

* chat: any message's text part; the chat template renders the conversation with each
  document's text between two private-use markers, which are then cut out: the text between
  them is tokenized on its own (its tokens are the same wherever it sits), the rest as the
  template made it;
* completions: `prompt` as a list of such parts (one prompt; plain strings stay strings).

Without `--blend-config` the marks change nothing but the tokenization at part boundaries.
"""

from __future__ import annotations

from typing import Any

from kvserve.blend.parts import DOCUMENT, tokenize_parts
from kvserve.server.protocol import APIError
from kvserve.utils.validation import check_text_fits

START, END = "\ue000", "\ue001"  # private-use characters around a document's rendered text


def is_document_part(part: Any) -> bool:
    control = getattr(part, "cache_control", None)
    return isinstance(control, dict) and control.get("type") == DOCUMENT


def has_documents(messages: list) -> bool:
    return any(isinstance(m.content, list) and any(is_document_part(p) for p in m.content)
               for m in messages)


def part_text(part: Any) -> str:
    """A chat content part's text as the template sees it (a document's between markers)."""
    if not is_document_part(part):
        return part.text
    if START in part.text or END in part.text:
        raise APIError(400, "a document's text must not contain U+E000 or U+E001",
                       param="messages")
    return f"{START}{part.text}{END}"


def split_rendered(text: str) -> list[Any]:
    """The rendered chat prompt as parts: plain strings and the marked documents."""
    parts: list[Any] = []
    rest = text
    while START in rest:
        before, _, rest = rest.partition(START)
        document, found, rest = rest.partition(END)
        if not found:
            raise APIError(400, "the chat template cut a document's text", param="messages")
        parts += [before, {"text": document, "cache_control": {"type": DOCUMENT}}]
    return parts + [rest]


def tokenized(tokenizer, parts: list[Any], special: bool, max_model_len: int,
              what: str = "the prompt") -> dict[str, Any]:
    """The engine's prompt for parts: token ids and document spans (`special`: the first
    part gets the tokenizer's special tokens; a chat template brings its own). A text that
    cannot fit is refused before any tokenizing."""
    def check(text: str) -> None:
        check_text_fits(tokenizer, text, max_model_len, what)

    try:
        if not special:
            parts = [""] + list(parts)  # (the first part alone gets special tokens)
        out = tokenize_parts(tokenizer, [p.model_dump(exclude_none=True)
                                         if hasattr(p, "model_dump") else p for p in parts],
                             check)
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt" if what == "the prompt"
                       else "messages") from exc
    return {"prompt": out.text, "prompt_token_ids": out.token_ids,
            "documents": [list(span) for span in out.documents]}
