"""Tool calls in a chat completion's text, as OpenAI's `tool_calls`.

`tool_choice` "auto": the Hermes / Qwen2.5 `<tool_call>{...}</tool_call>` blocks the chat
template teaches. `parse_tool_calls` splits a finished text into the content outside the calls
and the calls; `ToolCallStream` does the same incrementally for streaming: it releases content
as soon as it cannot be the start of a call, and a call once its closing tag has arrived (as
OpenAI's chunks: first the id, type and name with empty arguments, then the arguments). A block
that does not parse as `{"name": str, "arguments": object}` stays content, so nothing the model
wrote is lost.

A forced `tool_choice` (named, or "required"): `ForcedToolCalls` reads the JSON the grammar of
`kvserve.structured.tool_calls` holds the output to, streamed or not, with the same interface.
A call cut short by max_tokens is still a call, its arguments the text written so far.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.structured.tool_calls import TOOL_CALL_END, TOOL_CALL_START


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

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


_BLOCK = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the calls, stripped; the calls in order). A block that does not parse,
    and an unclosed one (cut by max_tokens), stay content."""
    content: list[str] = []
    calls: list[ToolCall] = []
    at = 0
    for block in _BLOCK.finditer(text):
        call = _parse_call(block.group(1))
        content.append(text[at:block.start()] if call is not None else text[at:block.end()])
        at = block.end()
        if call is not None:
            calls.append(call)
    content.append(text[at:])
    return "".join(content).strip(), calls


# The head of a call in the Hermes format, up to where its arguments' value begins.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class _OpenCall:
    index: int
    id: str
    args_at: int  # where the arguments' text begins in the buffer
    sent: int = 0  # characters of it sent


class ToolCallStream:
    """Incremental parser. `feed(delta)` returns (content to send now, the `delta.tool_calls`
    entries to send now): a call's first entry carries its index, id, type and name (with
    empty arguments), as soon as its name and the start of its arguments have arrived; later
    entries carry fragments of the arguments' text (the raw text the model wrote, held back
    from its last "}" on, which may close the call rather than the arguments)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet released: a possible call start, or an open call
        self._open: _OpenCall | None = None
        self.num_started = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += delta
        content: list[str] = []
        events: list[dict[str, Any]] = []
        while self._buffer:
            if self.num_started and self._open is None:  # between calls: whitespace is no content
                stripped = self._buffer.lstrip()
                if not stripped and not final:
                    break
                if TOOL_CALL_START.startswith(stripped[:len(TOOL_CALL_START)]) and stripped:
                    self._buffer = stripped
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, TOOL_CALL_START)
                content.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(TOOL_CALL_END)
            self._start_call(events)
            if end < 0:
                if self._open is not None:
                    self._send_args(events, self._buffer, closing=False)
                elif final:  # an unclosed call that never began: it is content
                    content.append(self._buffer)
                    self._buffer = ""
                break
            block = self._buffer[:end]
            self._buffer = self._buffer[end + len(TOOL_CALL_END):]
            call = _parse_call(block[len(TOOL_CALL_START):])
            if self._open is not None:  # streamed already: finish it with the rest
                if block[self._open.args_at:].lstrip().startswith('"'):
                    if call is not None:  # arguments written as a JSON string: sent decoded
                        events.append({"index": self._open.index,
                                       "function": {"arguments": call.arguments}})
                else:
                    self._send_args(events, block, closing=True)
                self._open = None
            elif call is None:
                content.append(block + TOOL_CALL_END)
            else:  # a block whose head did not match: sent whole
                self._open = _OpenCall(self.num_started, call.id, len(block))
                self.num_started += 1
                events.append(_first_event(self._open, call.name))
                events.append({"index": self._open.index,
                               "function": {"arguments": call.arguments}})
                self._open = None
        if final and self._open is not None:  # cut off inside a call (max_tokens)
            self._send_args(events, self._buffer, closing=False, final=True)
            self._buffer, self._open = "", None
        return "".join(content), events

    def _start_call(self, events: list[dict[str, Any]]) -> None:
        if self._open is not None:
            return
        head = _CALL_HEAD.match(self._buffer, len(TOOL_CALL_START))
        if head is None:
            return
        name = json.loads(f'"{head.group(1)}"')
        self._open = _OpenCall(self.num_started, new_call_id(), head.end())
        self.num_started += 1
        events.append(_first_event(self._open, name))

    def _send_args(self, events: list[dict[str, Any]], text: str, closing: bool,
                   final: bool = False) -> None:
        """Send what is known of the open call's arguments: all of them when the call has
        closed (up to its closing brace), else all but what may still turn out to be the
        call's own end (a trailing "}", whitespace, a partial closing tag)."""
        call = self._open
        assert call is not None
        args = text[call.args_at:]
        if args.lstrip().startswith('"'):  # a JSON string: sent decoded once the call closes
            return
        if closing:
            args = args[:max(args.rfind("}"), 0)].rstrip()
        elif not final:
            args = args[:len(args) - _partial_suffix(args, TOOL_CALL_END)].rstrip()
            if args.endswith("}"):
                args = args[:-1]
        if len(args) > call.sent:
            events.append({"index": call.index, "function": {"arguments": args[call.sent:]}})
            call.sent = len(args)


def _first_event(call: _OpenCall, name: str) -> dict[str, Any]:
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": name, "arguments": ""}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def assemble(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `message.tool_calls` that a stream's `delta.tool_calls` entries add up to."""
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        fn = event["function"]
        call = calls.get(event["index"])
        if call is None:
            call = calls[event["index"]] = {"id": event.get("id"), "type": "function",
                                            "function": {"name": fn.get("name"),
                                                         "arguments": ""}}
        call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# The forced formats (kvserve.structured.tool_calls): "required" writes a JSON array of calls.
_ARRAY_OPEN = re.compile(r"\s*\[")
_PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_ITEM_END = re.compile(r"\s*\}\s*([,\]])")


class ForcedToolCalls:
    """Incremental reader of a forced tool_choice's output, with `ToolCallStream`'s interface
    (`feed(delta, final)` -> (content, `delta.tool_calls` entries); `num_started`).

    `named`: the whole output is that function's arguments, sent as it comes (vLLM's stream of
    a named tool choice: the first entry carries the id, type, name and the first fragment).
    Otherwise `names` are the tools of "required" and the output is `[{"name": ..., "arguments":
    ...}, ...]`: a call's first entry goes out once its name has arrived, its arguments follow
    as fragments up to the end of their JSON value (found by a scan that knows strings and
    nesting, so nothing is held back). Cut short (`final` inside a call), a call keeps what was
    written of its arguments; a name cut short still names a call when only one tool's name
    begins that way. Output from which no call can be read comes back as content."""

    def __init__(self, named: str | None = None, names: Sequence[str] = ()) -> None:
        self._named = named
        self._names = list(names)
        self._buffer = ""
        self._at = 0  # where parsing resumes in the buffer
        self._state = "open"  # open -> head -> args -> end -> head ... -> done
        self._open: _OpenCall | None = None
        self._value: _ValueEnd | None = None
        self.num_started = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        events: list[dict[str, Any]] = []
        if self._named is not None:
            if self._open is None and (delta or final):
                self._start(events, self._named, 0)
                events[-1]["function"]["arguments"] = delta
            elif delta:
                events.append({"index": 0, "function": {"arguments": delta}})
            return "", events
        self._buffer += delta
        while self._step(events):
            pass
        if final and self._state == "head":
            self._start_cut_call(events)
        content = self._buffer if final and not self.num_started else ""
        return content, events

    def _step(self, events: list[dict[str, Any]]) -> bool:
        """Advance through the buffer by one part of the array; False when it needs more."""
        buf, state = self._buffer, self._state
        if state == "open":
            m = _ARRAY_OPEN.match(buf, self._at)
            if m is None:
                return False
            self._at, self._state = m.end(), "head"
        elif state == "head":
            m = _CALL_HEAD.match(buf, self._at)  # an item's head is a Hermes call's
            if m is None or m.end() == len(buf):  # (its whitespace may not have all come)
                return False
            self._start(events, json.loads(f'"{m.group(1)}"'), m.end())
            self._value, self._at, self._state = _ValueEnd(m.end()), m.end(), "args"
        elif state == "args":
            assert self._open is not None and self._value is not None
            end = self._value.advance(buf)
            self._send(events, len(buf) if end is None else end)
            if end is None:
                return False
            self._open, self._at, self._state = None, end, "end"
        elif state == "end":
            m = _ITEM_END.match(buf, self._at)
            if m is None:
                return False
            self._at, self._state = m.end(), "head" if m.group(1) == "," else "done"
        else:
            return False
        return True

    def _start(self, events: list[dict[str, Any]], name: str, args_at: int) -> None:
        self._open = _OpenCall(self.num_started, new_call_id(), args_at)
        self.num_started += 1
        events.append(_first_event(self._open, name))

    def _send(self, events: list[dict[str, Any]], end: int) -> None:
        """Send the open call's arguments up to `end` (an index into the buffer)."""
        call = self._open
        assert call is not None
        start = call.args_at + call.sent
        if end > start:
            events.append({"index": call.index,
                           "function": {"arguments": self._buffer[start:end]}})
            call.sent = end - call.args_at

    def _start_cut_call(self, events: list[dict[str, Any]]) -> None:
        """The output ended where a call (after "[" or ",") had to begin, before its
        arguments: a call still, if its name is known, that is if one tool only has a name
        that begins with what was written of it (any tool, when none of it was)."""
        m = _PARTIAL_NAME.match(self._buffer, self._at)
        written, closed = (m.group(1), bool(m.group(2))) if m is not None else ("", False)
        names = [n for n in self._names if (n == written if closed else n.startswith(written))]
        if len(names) == 1:
            self._start(events, names[0], len(self._buffer))


class _ValueEnd:
    """Finds where the JSON value that begins at `start` ends, as its text arrives."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.began = self.scalar = self.in_string = self.escaped = False

    def advance(self, text: str) -> int | None:
        """The end of the value (an index into `text`), or None if it has not arrived."""
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self.pos
            elif not self.began:
                if not ch.isspace():
                    self.began = True
                    self.in_string = ch == '"'
                    self.depth = int(ch in "{[")
                    self.scalar = not self.in_string and not self.depth
            elif self.scalar:
                if ch in ",}] \t\r\n":
                    self.pos -= 1
                    return self.pos
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None
