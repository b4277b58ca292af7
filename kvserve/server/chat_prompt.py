"""A chat request's prompt text, as the chat template renders it: the server's rendering, in a
module of its own (no engine, no torch) so that `kvserve diagnose` renders logged requests
exactly as the server rendered them, and starts in a blink."""

from __future__ import annotations

from typing import Any

from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.structured_request import history_tool_calls
from kvserve.server.documents import part_text

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt"}


def render_chat(tokenizer, req: ChatCompletionRequest) -> str:
    """The prompt text the chat template makes of a request (encode it without special
    tokens: the template has its own)."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "\n".join(part_text(part) for part in m.content)  # (documents marked)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = history_tool_calls(m.tool_calls, i)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS and isinstance(k, str)}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                         tools=req.tools or None, **kwargs)
