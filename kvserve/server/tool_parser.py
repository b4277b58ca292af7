"""Tool calls in a chat completion's text: the Hermes / Qwen2.5 `<tool_call>{...}</tool_call>`
format (kvserve.structured.tool_calls writes the grammar of the same format).

`parse_tool_calls` splits a finished text into the content outside the calls and the calls;
`ToolCallStream` does the same incrementally for streaming: it releases content as soon as it
cannot be the start of a call, and a call once its closing tag has arrived (as OpenAI's chunks:
first the id, type and name with empty arguments, then the arguments). A block that does not
parse as `{"name": str, "arguments": object}` stays content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.structured.tool_calls import TOOL_CALL_END, TOOL_CALL_START


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body, strict=False)  # raw control characters in strings too
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the calls, stripped; the calls in order)."""
    stream = ToolCallStream()
    content, calls = stream.feed(text, final=True)
    return content.strip(), calls


class ToolCallStream:
    """Incremental parser: `feed(delta)` returns (content to send now, calls completed now)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet released: a possible call start, or an open call
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buffer += delta
        if self.num_calls and not self._buffer.strip() and not final:
            return "", []  # whitespace after a call: it may separate it from the next one
        if self.num_calls:
            self._buffer = self._buffer.lstrip() if self._buffer.lstrip().startswith(
                TOOL_CALL_START[:len(self._buffer.lstrip())]) else self._buffer
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._buffer:
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, TOOL_CALL_START)
                content.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0:
                if final:  # an unclosed call: whatever it holds is content
                    content.append(self._buffer)
                    self._buffer = ""
                break
            block = self._buffer[:end + len(TOOL_CALL_END)]
            self._buffer = self._buffer[end + len(TOOL_CALL_END):]
            call = _parse_call(block[len(TOOL_CALL_START):-len(TOOL_CALL_END)])
            if call is None:
                content.append(block)
            else:
                calls.append(call)
                self.num_calls += 1
                stripped = self._buffer.lstrip()
                if not stripped or stripped.startswith(TOOL_CALL_START):
                    self._buffer = stripped  # the newline between two calls is no content
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
