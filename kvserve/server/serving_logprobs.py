"""How tokens and their logprobs are shown in responses: a token's name (its text, or OpenAI's
"bytes:\\xNN" form for a token that is only part of a UTF-8 character), and the logprob objects
of the completions API (OpenAI's legacy object, vLLM's `prompt_logprobs`); the chat API builds
its objects from the same names (serving_chat.py).

Why a module of its own: both endpoints must name a token the same way, and JSON has no -inf,
so one place holds the naming rule, its cache, and the floor a logprob is clamped to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.outputs import RequestOutput
from kvserve.tokenizer.tokenizer import BYTE_DECODER

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number


def finite_logprob(value: float) -> float:
    return value if value == value and value > MIN_LOGPROB else MIN_LOGPROB


def join_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects of consecutive tokens as one."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


class LogprobFormatter:
    """Token names (cached: a server names the same tokens over and over) and the logprob
    objects built from them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_strs: dict[int, tuple[str, bytes, int]] = {}

    def token_str(self, token_id: int) -> str:
        """How a token is shown in logprobs: its text, or (for a token that is only part of a
        UTF-8 character) OpenAI's "bytes:\\xNN" form, so that different tokens never share a
        name in `top_logprobs`."""
        return self._token_info(token_id)[0]

    def token_text_len(self, token_id: int) -> int:
        return self._token_info(token_id)[2]

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self._token_info(token_id)[1])

    def _token_info(self, token_id: int) -> tuple[str, bytes, int]:
        info = self._token_strs.get(token_id)
        if info is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw, length = text.encode(), len(text)
            if "\ufffd" in text:
                piece = self.tokenizer.id_to_token(token_id)
                if piece is not None and all(ch in BYTE_DECODER for ch in piece):
                    raw = bytes(BYTE_DECODER[ch] for ch in piece)  # byte-level BPE
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            info = (text, raw, length)
            if len(self._token_strs) < 1_000_000:
                self._token_strs[token_id] = info
        return info

    def completion_logprobs(self, token_ids: Sequence[int],
                             logprobs: Sequence[dict[int, float] | None] | None,
                             text_offset: int, top_n: int | None = None
                             ) -> tuple[dict[str, Any] | None, int]:
        """OpenAI's legacy logprobs object. An entry of None (the first prompt token under
        echo: nothing predicts it) gives null token_logprobs and top_logprobs. `top_n` keeps
        that many alternatives (and the token itself) of entries that hold more (prompt
        entries computed for a larger prompt_logprobs)."""
        if logprobs is None:
            return None, text_offset
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lps in zip(token_ids, logprobs):
            tokens.append(self.token_str(tid))
            offsets.append(text_offset)
            text_offset += self.token_text_len(tid)
            if lps is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(finite_logprob(lps.get(tid, MIN_LOGPROB)))
            ranked = sorted(lps.items(), key=lambda kv: -kv[1])
            if top_n is not None and len(ranked) > top_n + 1:
                ranked = ranked[:top_n] + [(tid, lps[tid])]
            top: dict[str, float] = {}
            for t, v in ranked:
                top.setdefault(self.token_str(t), finite_logprob(v))
            tops.append(top)
        return ({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                 "text_offset": offsets}, text_offset)

    def vllm_prompt_logprobs(self, out: RequestOutput, k: int
                              ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id:
        {"logprob", "rank", "decoded_token"}} for the actual token and the top k (ranks 1..k
        in order; the actual token's own rank from the engine)."""
        if out.prompt_logprobs is None:
            return None
        result: list[dict[str, dict[str, Any]] | None] = []
        ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
        for tid, entry, rank in zip(out.prompt_token_ids, out.prompt_logprobs, ranks):
            if entry is None:
                result.append(None)
                continue
            item: dict[str, dict[str, Any]] = {}
            item[str(tid)] = {"logprob": finite_logprob(entry[tid]), "rank": rank,
                              "decoded_token": self.token_str(tid)}
            tops = sorted(((t, v) for t, v in entry.items()), key=lambda kv: -kv[1])[:k]
            for r, (t, v) in enumerate(tops, start=1):
                item.setdefault(str(t), {"logprob": finite_logprob(v), "rank": r,
                                         "decoded_token": self.token_str(t)})
            result.append(item)
        return result
