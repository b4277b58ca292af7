"""Anthropic's Messages API on the chat engine: `POST /v1/messages` and `/v1/messages/count_tokens`.

A Messages request is turned into the chat completion it means (`chat_request`) and served by
the chat endpoint's own code, so that the chat template, tool calls, structured outputs, stop
strings, retention, the caller's namespace and the request log are exactly the chat
endpoint's; its answer, a chat.completion or its chunks, is then turned into Anthropic's
message or its event sequence (`message_start`, `content_block_start` / `delta` / `stop`,
`message_delta`, `message_stop`, with a `ping` after the start).

The conversation maps as the chat templates expect it: `system` (a string or text blocks, and
the 2.x SDK's `system` messages) is the system message; a user turn's `tool_result` blocks
become `tool` messages (in order, before the turn's text), an assistant turn's `tool_use`
blocks its `tool_calls`. `cache_control` on a block is a breakpoint at its message's end, on a
tool one at the end of the first message (the tools render before it), at the top of the
request one over the whole prompt: kvserve's retention with the breakpoint's TTL.

Usage, truthfully: `cache_read_input_tokens` is what the prefix cache served;
`cache_creation_input_tokens` is what this request wrote to the cache under its breakpoints:
the whole blocks up to the last breakpoint's end that it did not read (0 without a breakpoint,
as at Anthropic, and 0 when prefix caching is off); `input_tokens` is the rest, so the three
add up to the prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvserve.frontend.anthropic_errors import anthropic_error
from kvserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest, Tool
from kvserve.server.cache_control import message_control
from kvserve.server.protocol import APIError, ChatCompletionRequest
from kvserve.server.offload import off_loop, text_size
from kvserve.server.streaming import event_stream, sse

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _refuse(what: str, param: str) -> APIError:
    return APIError(400, what, param=param)


def _cc(block: dict[str, Any]) -> dict[str, Any] | None:
    return block.get("cache_control")


def _check_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    """Refuse a field kvserve cannot honour; a null one is absent (the SDK's response blocks,
    echoed back as history, carry `citations`, `caller` and `toolset_name` as null)."""
    extra = sorted(k for k, v in block.items() if k not in allowed and v is not None)
    if extra:
        raise _refuse(f"{where}: {', '.join(extra)} is not supported here", where)


def _text_parts(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Text blocks as the chat endpoint's content parts (with their breakpoints)."""
    parts = []
    for i, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _refuse(f"{where}[{i}]: a {b.get('type')!r} block is not supported here "
                          "(this server serves text: text, tool_use and tool_result blocks)",
                          f"{where}[{i}]")
        _check_keys(b, {"type", "text", "cache_control"}, f"{where}[{i}]")
        part = {"type": "text", "text": b["text"]}
        if _cc(b) is not None:
            part["cache_control"] = _cc(b)
        parts.append(part)
    return parts


def _tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    if not isinstance(b.get("tool_use_id"), str):
        raise _refuse(f"{where}: tool_use_id must be a string", where)
    content = b.get("content", "")
    text = content if isinstance(content, str) else "\n".join(
        p["text"] for p in _text_parts(list(content), f"{where}.content"))
    if b.get("is_error") is True:  # what the model is told of a failed call
        text = f"Error: {text}" if text else "Error"
    msg = {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}
    if _cc(b) is not None:
        msg["cache_control"] = _cc(b)
    return msg


def _tool_use(b: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(b, {"type", "id", "name", "input", "cache_control"}, where)
    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
            or not isinstance(b.get("input"), dict):
        raise _refuse(f"{where}: a tool_use block has a string id and name and an object "
                      "input", where)
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}


def _turn(role: str, content, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [b.model_dump() for b in content]
    if role == "system":
        return [{"role": "system", "content": _text_parts(blocks, where)}]
    out, texts, calls, marked = [], [], [], None
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "tool_result" and role == "user":
            out.append(_tool_result(b, f"{where}[{j}]"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(b, f"{where}[{j}]"))
            marked = _cc(b) or marked
        else:
            texts.append((j, b))
    parts = [p for j, b in texts for p in _text_parts([b], f"{where}[{j}]")]
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": parts or ""}
        if calls:
            msg["tool_calls"] = calls
        if marked is not None:
            msg["cache_control"] = marked
        return [msg]
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def chat_messages(req: CountTokensRequest | MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        out.append({"role": "system", "content": req.system})
    elif req.system is not None:
        out.append({"role": "system", "content": _text_parts(
            [b.model_dump() for b in req.system], "system")})
    for i, m in enumerate(req.messages):
        out += _turn(m.role, m.content, i)
    if not out:
        raise _refuse("messages: nothing to answer (no text and no tool result)", "messages")
    return out


def _tools(req: CountTokensRequest | MessagesRequest
           ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """tools and tool_choice in the chat endpoint's terms, and the tools' breakpoint (the
    first message's: the chat templates render the tools before it)."""
    fields: dict[str, Any] = {}
    marked = None
    if req.tools:
        tools = []
        for i, raw in enumerate(req.tools):
            spec = raw.model_dump(exclude_none=True)
            if spec.get("type", "custom") != "custom":
                raise _refuse(f"tools[{i}]: the server tool {spec['type']!r} is not supported "
                              "here (only custom tools, run by the client)", f"tools[{i}]")
            try:
                tool = Tool.model_validate(spec)
            except ValidationError as exc:
                raise _refuse(f"tools[{i}]: {exc.errors()[0]['msg']}", f"tools[{i}]") from None
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
            if tool.cache_control is not None:
                marked = tool.cache_control.model_dump(exclude_none=True)
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise _refuse("tool_choice: {\"type\": \"tool\"} needs the tool's name",
                              "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required",
                                     "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields, marked


def chat_request(req: MessagesRequest | CountTokensRequest, stream: bool = False
                 ) -> ChatCompletionRequest:
    """The chat completion a Messages request means (400 for what cannot be served)."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise _refuse("extended thinking is not supported by this server", "thinking")
    output = req.output_config
    if output is not None and output.effort is not None:
        raise _refuse("output_config.effort is not supported (the model does not reason)",
                      "output_config")
    messages = chat_messages(req)
    tools, marked = _tools(req)
    if marked is not None and "cache_control" not in messages[0]:
        messages[0]["cache_control"] = marked
    body: dict[str, Any] = {"model": req.model, "messages": messages, "cache_salt": req.cache_salt,
                            **tools}
    if output is not None and output.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output.format.schema_}}
    if req.cache_control is not None:
        body["cache_control"] = req.cache_control.model_dump(exclude_none=True)
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=max(req.max_tokens, 1), stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    user=req.metadata.user_id if req.metadata is not None else None,
                    kv_cache_report=req.kv_cache_report, stream=stream,
                    stream_options={"include_usage": True} if stream else None)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise _refuse(f"{where}: {err.get('msg')}", where or None) from None


class MessagesServing:
    """The two routes, over the chat endpoint's serving object."""

    def __init__(self, chat) -> None:
        self.chat = chat  # OpenAIServingChat

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        chat = chat_request(req)
        prompt = await off_loop(text_size([m.content for m in chat.messages]),
                                self.chat._chat_prompt, chat)
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    def _prompt_and_breakpoint(self, chat: ChatCompletionRequest) -> tuple[int, int | None]:
        """The prompt's length, and where its last cache breakpoint ends (None: none)."""
        ids = self.chat._chat_prompt(chat)["prompt_token_ids"]
        if chat.cache_control is not None:
            return len(ids), len(ids)
        if not any(message_control(m) is not None for m in chat.messages):
            return len(ids), None
        return len(ids), max((e for e in self.chat._message_ends(chat, ids) if e is not None),
                             default=None)

    def usage(self, usage: dict[str, Any], end: int | None) -> dict[str, Any]:
        prompt = usage["prompt_tokens"]
        read = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        created = 0
        core = self.chat.engine
        if end is not None and core.config.enable_prefix_caching:
            bs = core.block_size
            created = max(0, min(end, prompt - 1) // bs * bs - read)
        return {"input_tokens": prompt - read - created, "output_tokens":
                usage["completion_tokens"], "cache_creation_input_tokens": created,
                "cache_read_input_tokens": read, "service_tier": "standard"}

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        model = self.chat.check_model(req.model)
        chat = chat_request(req, stream=bool(req.stream) and req.max_tokens > 0)
        prompt, end = await off_loop(text_size([m.content for m in chat.messages]),
                                     self._prompt_and_breakpoint, chat)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        answer = await self.chat.create_chat_completion(chat, raw)
        if answer.status_code != 200:
            return answer  # 499: the client went away (streamed or not)
        if req.stream and req.max_tokens > 0:
            inner = answer.body_iterator
            return event_stream(self._events(inner, mid, model, req, (prompt, end)),
                                getattr(answer, "_on_close", lambda: None))
        body = json.loads(answer.body)
        message = self._message(body, mid, model, req, end)
        if req.stream:  # max_tokens 0, streamed: the events of an empty answer
            return event_stream(_replay(message), lambda: None)
        return JSONResponse(message)

    def _message(self, body: dict[str, Any], mid: str, model: str, req: MessagesRequest,
                 end: int | None) -> dict[str, Any]:
        choice = body["choices"][0]
        msg = choice["message"]
        content: list[dict[str, Any]] = []
        usage = self.usage(body["usage"], end)
        if req.max_tokens == 0:  # the cache filled, nothing answered
            usage["output_tokens"] = 0
            stop, seq = "max_tokens", None
        else:
            if msg.get("content"):
                content.append({"type": "text", "text": msg["content"]})
            for call in msg.get("tool_calls") or ():
                content.append(_tool_block(call["id"], call["function"]["name"],
                                           call["function"]["arguments"]))
            stop, seq = _stop(choice.get("finish_reason"), choice.get("stop_reason"), req,
                              any(b["type"] == "tool_use" for b in content))
        out = {"id": mid, "type": "message", "role": "assistant", "model": model,
               "content": content, "stop_reason": stop, "stop_sequence": seq, "usage": usage}
        if "kv_cache_report" in body:
            out["kv_cache_report"] = body["kv_cache_report"]
        return out

    async def _events(self, inner: AsyncIterator[str], mid: str, model: str,
                      req: MessagesRequest, prompt: tuple[int, int | None]
                      ) -> AsyncIterator[str]:
        """The chat chunks as Anthropic's events. `message_start` gives the prompt's length
        as input_tokens (what the cache will serve is known only once the request is
        admitted); `message_delta` carries the final usage, which the SDK takes over."""
        num_prompt, end = prompt
        started = False
        block: int = -1  # the open content block's index
        kind: str | None = None
        has_tools = False
        finish = stop_str = None
        usage = report = None
        try:
            async for raw in inner:
                if not raw.startswith("data: ") or raw.startswith("data: [DONE]"):
                    continue
                chunk = json.loads(raw[6:])
                if "error" in chunk:  # headers are out: the error is an event
                    server = chunk["error"].get("type") == "server_error"
                    yield _event("error", anthropic_error(500 if server else 400,
                                                          chunk["error"]["message"]))
                    return
                if not started:
                    started = True
                    yield _event("message_start", {"type": "message_start", "message": {
                        "id": mid, "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": num_prompt, "output_tokens": 0,
                                  "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 0}}})
                    yield _event("ping", {"type": "ping"})
                usage = chunk.get("usage") or usage
                report = chunk.get("kv_cache_report", report)
                for choice in chunk.get("choices", ()):
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        if kind != "text":
                            if kind is not None:
                                yield _stop_block(block)
                            block, kind = block + 1, "text"
                            yield _event("content_block_start", {
                                "type": "content_block_start", "index": block,
                                "content_block": {"type": "text", "text": ""}})
                        yield _event("content_block_delta", {
                            "type": "content_block_delta", "index": block,
                            "delta": {"type": "text_delta", "text": delta["content"]}})
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):
                            if kind is not None:
                                yield _stop_block(block)
                            block, kind, has_tools = block + 1, "tool_use", True
                            yield _event("content_block_start", {
                                "type": "content_block_start", "index": block,
                                "content_block": {"type": "tool_use", "id": call["id"],
                                                  "name": fn.get("name", ""), "input": {}}})
                        if fn.get("arguments"):
                            yield _event("content_block_delta", {
                                "type": "content_block_delta", "index": block,
                                "delta": {"type": "input_json_delta",
                                          "partial_json": fn["arguments"]}})
                    if choice.get("finish_reason") is not None:
                        finish, stop_str = choice["finish_reason"], choice.get("stop_reason")
            if kind is not None:
                yield _stop_block(block)
            stop, seq = _stop(finish, stop_str, req, has_tools)
            delta_body: dict[str, Any] = {
                "type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                "usage": self.usage(usage, end) if usage else {"output_tokens": 0}}
            if report is not None:
                delta_body["kv_cache_report"] = report
            yield _event("message_delta", delta_body)
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            await inner.aclose()


def _tool_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:  # cut off by max_tokens mid-call
        args = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


def _stop(finish: str | None, stop_str, req: MessagesRequest, tools: bool
          ) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence from the chat finish."""
    if tools and finish in ("stop", "tool_calls"):
        return "tool_use", None
    if finish == "stop" and isinstance(stop_str, str) and stop_str in (req.stop_sequences or ()):
        return "stop_sequence", stop_str
    if finish == "stop":
        return "end_turn", None
    return STOP_REASONS.get(finish or "", "end_turn"), None


def _event(name: str, data: dict[str, Any]) -> str:
    return sse(data, event=name)


def _stop_block(index: int) -> str:
    return _event("content_block_stop", {"type": "content_block_stop", "index": index})


async def _replay(message: dict[str, Any]) -> AsyncIterator[str]:
    """A finished message as the event sequence a stream of it would have been."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _event("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
        "usage": message["usage"]})
    yield _event("message_stop", {"type": "message_stop"})
