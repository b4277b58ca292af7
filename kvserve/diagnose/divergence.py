"""Where each request leaves the requests before it.

For request i, its nearest earlier request is the one (same cache salt: a salt keys every block,
so requests of different salts never share one) with the longest common prefix; the
divergence point is the end of that prefix, in characters of the rendered prompt and in
tokens. That is where the prefix cache stops serving request i at best, and what sits there
says why.

Why sorted neighbours rather than a trie: among strings kept sorted, the one sharing the longest
prefix with a new string is next to where the new one sorts, so each request costs a bisection
and two prefix comparisons, with no per-character structure in Python.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvserve.diagnose.render import Rendered
from kvserve.kv.prefix_index import common_prefix


@dataclass
class Divergence:
    index: int  # the request
    other: int  # its nearest earlier request (same salt); -1 when it is the first
    char: int  # length of the common prefix in characters (0 for token-id prompts)
    token: int  # ... in tokens
    length_chars: int  # the request's prompt length in characters
    length_tokens: int

    @property
    def identical(self) -> bool:
        """The whole prompt was seen before (nothing to classify)."""
        return self.other >= 0 and self.token >= self.length_tokens


class _Nearest:
    """Sequences seen so far, sorted, with the request each came from."""

    def __init__(self) -> None:
        self.keys: list = []
        self.owners: list[int] = []

    def nearest(self, key) -> tuple[int, int]:
        """(owner, common prefix length) of the seen sequence sharing the longest prefix."""
        pos = bisect.bisect_left(self.keys, key)
        best = (-1, -1)
        for j in (pos - 1, pos):
            if 0 <= j < len(self.keys):
                n = common_prefix(self.keys[j], key)
                if n > best[1]:
                    best = (self.owners[j], n)
        return best if best[0] >= 0 else (-1, 0)

    def add(self, key, owner: int) -> None:
        pos = bisect.bisect_left(self.keys, key)
        if pos < len(self.keys) and self.keys[pos] == key:
            return  # keep the first owner: the earliest request with that prompt
        self.keys.insert(pos, key)
        self.owners.insert(pos, owner)


def find_divergences(rendered: list[Rendered]) -> list[Divergence]:
    """Each request's divergence from its nearest earlier request, in order. The nearest is
    chosen by text when the prompt has text (what classification reads), else by tokens."""
    by_salt: dict[str | None, tuple[_Nearest, _Nearest]] = {}
    out = []
    for i, r in enumerate(rendered):
        texts, tokens = by_salt.setdefault(r.cache_salt, (_Nearest(), _Nearest()))
        tok = tuple(r.token_ids)
        if r.text is not None:
            other, char = texts.nearest(r.text)
            ntok = common_prefix(rendered[other].token_ids, r.token_ids) if other >= 0 else 0
            texts.add(r.text, i)
        else:
            other, ntok = tokens.nearest(tok)
            char = 0
        tokens.add(tok, i)
        out.append(Divergence(i, other, char, ntok, len(r.text or ""), len(r.token_ids)))
    return out
