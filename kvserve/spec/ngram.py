"""N-gram prompt lookup: draft the tokens that followed the last time the sequence's most
recent n tokens appeared in it (prompt and output alike).

Why it pays: text that quotes its prompt (a file rewritten with one change, an answer citing a
document, a chat repeating earlier turns) continues the way it did before, and finding that
costs a scan of token ids, no model. The longest n in [min, max] that matches wins (a longer
match is likelier to continue the same way); among its occurrences the most recent one, since
what was said last is what is being repeated now.
"""

from __future__ import annotations

import numpy as np


def ngram_draft(token_ids: list[int] | np.ndarray, k: int, n_min: int, n_max: int
                ) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's longest
    suffix of length n in [n_min, n_max]; [] when no such suffix occurred before."""
    ids = np.asarray(token_ids, dtype=np.int64)
    size = len(ids)
    if k <= 0 or size <= n_min:
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        start = _latest_match(ids, n)
        if start is not None:
            follow = start + n
            return ids[follow:follow + k].tolist()
    return []


def _latest_match(ids: np.ndarray, n: int) -> int | None:
    """The latest start s < len - n with ids[s:s + n] == ids[-n:], or None."""
    size = len(ids)
    tail = ids[size - n:]
    # candidates: starts whose first token matches, the occurrence itself left out
    starts = np.flatnonzero(ids[:size - n] == tail[0])
    for offset in range(1, n):
        if not len(starts):
            return None
        starts = starts[ids[starts + offset] == tail[offset]]
    return int(starts[-1]) if len(starts) else None
