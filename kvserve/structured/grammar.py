"""Grammars for structured outputs, with xgrammar (docs/structured_output.md says why).

`build_grammar` turns a `StructuredOutputsParams` into an xgrammar Grammar (the server's
compiler, kvserve/structured/compiler.py, and its compile processes build it alike). A
request's `GrammarState` is a matcher over it:
it fills the packed bitmask of the tokens allowed next (int32 words, bit t of word t // 32 for
token t, as `kvserve.sampler` reads it), advances on each accepted token and says when the
grammar has ended (its stop token was accepted).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from kvserve.structured.params import StructuredOutputsParams

# Whitespace a JSON grammar allows between tokens, at most, unless disable_any_whitespace: an
# unbounded run would let a weak model emit spaces until max_tokens.
MAX_JSON_WHITESPACE = 2

_REGEX_SPECIAL = set("\\.^$*+?{}[]|()/")


def _xgr():
    import xgrammar

    return xgrammar


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (regex metacharacters escaped)."""
    return "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c)
                          for c in choices) + ")"


def vocab_type(tokenizer) -> int:
    """How the tokenizer writes bytes in its vocabulary: byte-level (GPT-2 style), byte
    fallback (<0xNN> pieces, SentencePiece style) or raw text."""
    xgr = _xgr()
    spec = json.loads(tokenizer.backend.to_str())
    text = json.dumps(spec.get("decoder"))
    if "ByteLevel" in text:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in text:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def build_grammar(params: StructuredOutputsParams):
    """The (uncompiled) xgrammar Grammar for `params` (the parent and the compile workers
    build it alike)."""
    xgr = _xgr()
    kind = params.kind
    ws = dict(any_whitespace=not params.disable_any_whitespace,
              max_whitespace_cnt=None if params.disable_any_whitespace
              else MAX_JSON_WHITESPACE)
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return strict_json_strings(xgr.Grammar.from_json_schema(schema, **ws))
    if kind == "json_object":
        return strict_json_strings(xgr.Grammar.from_json_schema(
            '{"type": "object"}', strict_mode=False, **ws))
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(list(params.choice)))
    if kind == "grammar":
        return _grammar_from_text(params.grammar)
    raise AssertionError(kind)


# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (maxLength) as
# [^"\\\r\n], which lets raw control characters through, and JSON forbids them (a strict
# json.loads refuses such output). Both that class and the one of its unbounded strings also
# accept the three-byte forms of UTF-16 surrogates (ED A0 80 .. ED BF BF), which are not valid
# UTF-8: a random-weight model wrote one as a "one-character" string that decodes to three
# U+FFFD. The strict class excludes control characters and surrogates.
_LOOSE_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def strict_json_strings(grammar):
    """`grammar` with every JSON string character class excluding control characters and
    UTF-16 surrogates (so a string's characters are valid UTF-8 and JSON)."""
    text = str(grammar)
    if not any(loose in text for loose in _LOOSE_STRING_CHARS):
        return grammar
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _STRICT_STRING_CHAR)
    return _xgr().Grammar.from_ebnf(text)


def library_reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[11:10:03] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip()
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)
    return text[:500]


def _grammar_from_text(text: str):
    """EBNF (GBNF as xgrammar reads it) or, when that fails and it looks like Lark, Lark."""
    xgr = _xgr()
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:
        if ":" in text and "::=" not in text:
            return xgr.Grammar.from_lark(text)
        raise ebnf_error


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into row `row` of an int32 [rows, words] tensor."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
