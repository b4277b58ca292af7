"""A request's prefix key: the chained block hashes its replica will give its prompt.

The gateway routes by the same names the replicas' prefix caches use (kv/hashing.py): xxh3 over
the parent hash, the block's token ids and the request's `cache_salt`. So when the gateway knows
the token ids — the request sends them, or the gateway has the served model's tokenizer and chat
template (`--tokenizer`) — its keys are exactly the replicas' block hashes, and the KV events a
replica publishes (BlockStored / BlockRemoved, by hash) correct the gateway's picture directly.

Without a tokenizer, text is keyed by its UTF-8 bytes in blocks of `block_size x
TEXT_BYTES_PER_TOKEN` bytes (about a block of tokens): the keys still name prefixes (equal
leading text, equal leading keys), so routing history works, but they are not the replicas'
hashes and KV events cannot correct them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.frontend.tenancy import cache_namespace, key_digest

TEXT_BYTES_PER_TOKEN = 4  # a rough BPE average; only the granularity of text keys depends on it


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def first_prompt(prompt: Any) -> str | list[int] | None:
    """The completion request's first prompt (a request with several is routed by its first):
    text or token ids, or None when the body has none the gateway understands."""
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and prompt:
        head = prompt[0]
        if isinstance(head, str) or _is_token_ids(head):
            return head
    return None


def chat_messages(messages: Any) -> list[dict[str, Any]] | None:
    """Messages as the server renders them (content parts joined by newlines), or None."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif not isinstance(content, str):
            return None
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _texts(blocks: Any) -> str | None:
    """Anthropic content: a string, or its text blocks joined as the server joins them."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return None
    return "\n".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                     and isinstance(b.get("text"), str))


def anthropic_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list | None]:
    """A Messages body (`/v1/messages`) as the chat messages and tools the server renders it
    with (kvserve/server/serving_messages.py), as far as text goes: tool blocks are left out,
    so a conversation's keys stop matching the replica's where one stands (routing only)."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _texts(body["system"])
        if system is None:
            return None, None
        out.append({"role": "system", "content": system})
    for m in body.get("messages") or ():
        if not isinstance(m, dict) or _texts(m.get("content")) is None:
            return None, None
        out.append({"role": m.get("role"), "content": _texts(m["content"])})
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "parameters": t.get("input_schema"),
        **({"description": t["description"]} if "description" in t else {})}}
        for t in body.get("tools") or () if isinstance(t, dict)] or None
    return chat_messages(out) if out else None, tools


class PrefixKeyer:
    """Turns a request body into its prefix key (a list of chained block hashes)."""

    def __init__(self, block_size: int, tokenizer=None, kv_isolation: str = "cache_salt"
                 ) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.tokenizer = tokenizer  # kvserve.tokenizer.tokenizer.Tokenizer, or None
        self.kv_isolation = kv_isolation  # the replicas' --kv-isolation (kvserve/frontend/tenancy.py)

    def token_keys(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        return chain_hashes(token_ids, self.block_size, extra_keys(salt))

    def text_keys(self, text: str, salt: str | None) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        return chain_hashes(data, self.block_size * TEXT_BYTES_PER_TOKEN,
                            b"text:" + extra_keys(salt))

    def keys(self, path: str, body: dict[str, Any], api_key: str | None = None) -> list[int]:
        """The body's prefix key for `path` (/v1/completions, /v1/chat/completions or
        Anthropic's /v1/messages), in the namespace the replicas give it (its cache_salt, or
        under api_key isolation the client's `api_key` too); an empty list when there is
        nothing to key by (the policy then balances load)."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        salt = cache_namespace(self.kv_isolation, salt,
                               None if api_key is None else key_digest(api_key))
        if path.endswith("/count_tokens"):
            return []  # counted, not run: any replica
        if path.endswith("/chat/completions") or path.endswith("/messages"):
            if path.endswith("/messages"):
                messages, tools = anthropic_chat(body)
                generation_prompt = True
            else:
                messages, tools = chat_messages(body.get("messages")), body.get("tools")
                generation_prompt = body.get("add_generation_prompt", True) is not False
            if messages is None:
                return []
            if self.tokenizer is not None:
                try:
                    text = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=generation_prompt, tools=tools or None)
                    return self.token_keys(self.tokenizer.encode(text, False), salt)
                except Exception:  # the replica will answer the error; key by text meanwhile
                    pass
            text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
            return self.text_keys(text, salt)
        prompt = first_prompt(body.get("prompt"))
        if prompt is None:
            return []
        if isinstance(prompt, list):
            return self.token_keys(prompt, salt)
        if self.tokenizer is not None:
            try:
                return self.token_keys(self.tokenizer.encode(prompt, True), salt)
            except Exception:
                pass
        return self.text_keys(prompt, salt)
