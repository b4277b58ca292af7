"""The /v1/chat/completions handler: messages -> the chat template's prompt -> one engine request
-> OpenAI's chat.completion (JSON) or chat.completion.chunk events, with tool calls read from the
output (kvserve.server.tool_parser) as the request's `ToolPlan` says.

OpenAI's fields for stored completions and service tiers (`metadata`, `store`, `service_tier`):
vLLM's chat request does not declare them, so it drops them with an "ignored fields" warning
and its responses carry no metadata (and a null service_tier). kvserve refuses unknown fields,
so it declares these, and follows OpenAI where vLLM has nothing to follow: `metadata` is
checked as OpenAI documents it (protocol.py) and echoed in the chat.completion object, as
OpenAI's stored completions return it; `service_tier` takes OpenAI's values and the response
(each chunk too) names the tier that served it, "default", the only one kvserve has. `store`
follows vLLM: accepted, without effect, since kvserve stores no completion.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.auth import Caller
from kvserve.server.cache_control import chat_message_ends, message_control, request_retention
from kvserve.server.chat_prompt import render_chat
from kvserve.server.protocol import APIError, CacheExplainRequest, CachePinRequest, \
    ChatCompletionRequest, StreamOptions
from kvserve.server.offload import off_loop, text_size
from kvserve.server.serving import ChoiceCursor, Prepared, engine_error
from kvserve.server.serving_completion import OpenAIServingCompletion
from kvserve.server.serving_logprobs import MIN_LOGPROB, finite_logprob
from kvserve.server.streaming import event_stream, reports_field, sse, transfer_field
from kvserve.server.structured_request import ToolPlan, structured_outputs_of, tool_plan
from kvserve.server.documents import has_documents, split_rendered, tokenized

SERVED_TIER = "default"  # what `service_tier` reports: kvserve has one tier


class OpenAIServingChat(OpenAIServingCompletion):
    """The completions server with /v1/chat/completions: the one object that serves both."""

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        self._check_common(req, cid)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        structured = structured_outputs_of(req)
        tools = tool_plan(req, structured)
        if tools.grammar is not None:
            structured = tools.grammar
        self._check_size(1, req.n)
        if not await self._check_grammar(structured, "tool_choice" if tools.grammar is not None
                                         else "structured_outputs"
                                         if req.structured_outputs is not None
                                         else "response_format", req, raw):
            return Response(status_code=499)
        prompt = await off_loop(text_size([m.content for m in req.messages]),
                                self._chat_prompt, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        ids = prompt["prompt_token_ids"]
        retention = await off_loop(text_size([m.content for m in req.messages]),
                                   request_retention, req, lambda: self._message_ends(req, ids))
        params = self._sampling_params(req, max_tokens, logprobs, req.prompt_logprobs,
                                       structured, retention)
        prep = self.prepared([prompt], params, req, raw)
        created = int(time.time())
        streams = await self._add_all(prep, cid, req, req.stream, arrival)
        if req.stream:
            return event_stream(self._chat_events(prep, streams, cid, created, model, req,
                                                  tools, arrival),
                                lambda: self._abort_all(prep, streams))
        outputs = await self._collect(raw, prep, streams)
        if outputs is None:
            return Response(status_code=499)
        self._log_requests(req, prep, outputs, arrival)
        out = outputs[0]
        choices = []
        for c in out.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if tools.parse:
                content, calls = tools.read(c.text)
                if calls:  # cut off by max_tokens, still calls, and finish_reason "length"
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = _tool_finish(finish, tools)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs,
                                                            req.top_logprobs)
                            if req.logprobs else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": self._usage(outputs), **_echoed(req),
                **transfer_field(outputs)}
        if req.kv_cache_report:
            body.update(reports_field(outputs))
        if req.prompt_logprobs is not None:  # vLLM's field, beside the choices
            body["prompt_logprobs"] = self.logprob_format.vllm_prompt_logprobs(
                out, req.prompt_logprobs)
        return JSONResponse(body)

    async def explain_cache(self, req: CacheExplainRequest, caller: Caller) -> dict[str, Any]:
        """POST /v1/cache/explain: the cache report a request for this prompt would get now,
        rendered and tokenized as the real one is, read on the engine's thread between steps
        without running anything; in the caller's namespace, and about its own tokens only
        unless the caller is the admin (server/auth.py)."""
        self.check_model(req.model)
        prompt = await self.cache_prompt(req)
        salt = self.access.namespace(caller, req.cache_salt)
        try:
            return await self.engine.explain_cache(
                {"prompt_token_ids": prompt["prompt_token_ids"]}, salt,
                req.prompt_logprobs, full=caller.admin)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from exc

    async def cache_prompt(self, req: CacheExplainRequest | CachePinRequest) -> dict[str, Any]:
        """The prompt of a /v1/cache request (a prompt, or messages rendered as a chat request
        renders them), tokenized."""
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         chat_template_kwargs=req.chat_template_kwargs,
                                         tools=req.tools)
            return await off_loop(text_size([m.content for m in req.messages]),
                                  self._chat_prompt, chat)
        [prompt] = await off_loop(text_size(req.prompt), self._completion_prompts, req.prompt)
        return prompt

    def _message_ends(self, req: ChatCompletionRequest, ids: list[int]) -> list[int | None]:
        """Where each message with a breakpoint ends in the prompt (server/cache_control.py)."""
        def render_ids(n: int) -> list[int]:
            cut = req.model_copy(update={"messages": req.messages[:n],
                                         "add_generation_prompt": False})
            return self._chat_prompt(cut)["prompt_token_ids"]

        marked = [i for i, m in enumerate(req.messages) if message_control(m) is not None]
        return chat_message_ends(render_ids, ids, len(req.messages), marked)

    def _chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        try:
            text = render_chat(self.tokenizer, req)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # a template is user-supplied code: any failure is a 400
            raise APIError(400, f"chat template error: {type(exc).__name__}: {exc}",
                           param="messages") from exc
        if has_documents(req.messages):  # kvserve/server/documents.py
            return tokenized(self.tokenizer, split_rendered(text), False,
                             self.engine.max_model_len, "the chat prompt")
        return {"prompt": text,
                "prompt_token_ids": self._encode(text, False, "the chat prompt")}

    def _chat_logprobs(self, token_ids: Sequence[int],
                       logprobs: Sequence[dict[int, float]] | None,
                       top_n: int | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = []
        names = self.logprob_format
        for tid, lps in zip(token_ids, logprobs):
            s = names.token_str(tid)
            top = []
            if top_n:
                for t, v in sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]:
                    ts = names.token_str(t)
                    top.append({"token": ts, "logprob": finite_logprob(v),
                                "bytes": names.token_bytes(t)})
            content.append({"token": s, "logprob": finite_logprob(lps.get(tid, MIN_LOGPROB)),
                            "bytes": names.token_bytes(tid), "top_logprobs": top})
        return {"content": content}

    async def _chat_events(self, prep: Prepared, streams: list[RequestStream], cid: str,
                           created: int, model: str, req: ChatCompletionRequest,
                           tools: ToolPlan, arrival: float = 0.0) -> AsyncIterator[str]:
        cursors = [ChoiceCursor() for _ in range(req.n)]
        parsers = [tools.parser() for _ in range(req.n)] if tools.parse else None
        tier = {"service_tier": SERVED_TIER} if req.service_tier is not None else {}
        last: RequestOutput | None = None
        opts = req.stream_options or StreamOptions()
        num_prompt = len(prep.prompts[0]["prompt_token_ids"])

        def chunk(index: int, delta: dict[str, Any], logprobs=None, finish=None, stop=None,
                  c: CompletionOutput | None = None):
            body = {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, **tier, "choices": [{
                        "index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish, "stop_reason": stop}]}
            if opts.continuous_usage_stats:
                body["usage"] = self._choice_usage(num_prompt, c)
            return sse(body)

        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for _, out in self._merge(streams):
                last = out
                for c in out.outputs:
                    cur = cursors[c.index]
                    if cur.done:
                        continue
                    delta = self._text_delta(c, cur, prep.stop_list)
                    lp = None
                    if req.logprobs and c.logprobs is not None \
                            and len(c.token_ids) > cur.num_tokens:
                        lp = self._chat_logprobs(c.token_ids[cur.num_tokens:],
                                                 c.logprobs[cur.num_tokens:], req.top_logprobs)
                        cur.num_tokens = len(c.token_ids)
                    finished = c.finish_reason is not None
                    finish = c.finish_reason
                    if parsers is not None:
                        parser = parsers[c.index]
                        delta, calls = parser.feed(delta, final=finished)
                        for entry in calls:
                            if tools.max_calls is None or entry["index"] < tools.max_calls:
                                yield chunk(c.index, {"tool_calls": [entry]}, c=c)
                        if parser.num_started:
                            finish = _tool_finish(finish, tools)
                    if not delta and lp is None and not finished:
                        continue
                    cur.done = finished
                    yield chunk(c.index, {"content": delta} if delta or not finished else {},
                                lp, finish, c.stop_reason, c)
            self._log_requests(req, prep, [last], arrival)
            if opts.include_usage:
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                           "model": model, **tier, "choices": [],
                           "usage": self._usage([last])})
            if req.kv_cache_report:  # a last chunk of its own, as the usage has
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                           "model": model, **tier, "choices": [], **reports_field([last])})
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield sse(engine_error(exc).body())
            yield "data: [DONE]\n\n"
        finally:
            self._abort_all(prep, streams)


def _echoed(req: ChatCompletionRequest) -> dict[str, Any]:
    """What a chat.completion object repeats of the request (see the module docstring)."""
    out: dict[str, Any] = {}
    if req.service_tier is not None:
        out["service_tier"] = SERVED_TIER
    if req.metadata is not None:
        out["metadata"] = req.metadata
    return out


def _tool_finish(finish: str | None, tools) -> str | None:
    """A finished call's finish_reason as OpenAI and vLLM give it: "tool_calls" when the model
    chose to call (auto) or had to call one of several (required), "stop" for a named
    tool_choice (the caller already knows what is called); "length" stays "length"."""
    if finish != "stop" or tools.named is not None:
        return finish
    return "tool_calls"
