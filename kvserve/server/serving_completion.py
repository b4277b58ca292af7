"""The /v1/completions handler (`OpenAIServingCompletion`): a prompt (text, token ids, several
of them, or documents) -> one engine request per prompt -> OpenAI's text_completion object
(JSON) or its server-sent events, with echo, the legacy logprobs object and vLLM's
prompt_logprobs.

The chat endpoint's class (serving_chat.py) derives from this one, so one server object serves
both endpoints; what they share (checks, sampling parameters, adding and collecting engine
requests, streaming cursors) is the base, serving.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import RequestOutput
from kvserve.server.cache_control import request_retention
from kvserve.server.documents import tokenized
from kvserve.server.offload import off_loop, text_size
from kvserve.server.protocol import APIError, CompletionRequest, StreamOptions, TextPart
from kvserve.server.serving import ChoiceCursor, OpenAIServing, Prepared, engine_error
from kvserve.server.serving_logprobs import join_logprobs
from kvserve.server.streaming import event_stream, reports_field, sse, transfer_field
from kvserve.server.structured_request import structured_outputs_of


class OpenAIServingCompletion(OpenAIServing):
    """OpenAIServing with /v1/completions."""

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        cid = f"cmpl-{uuid.uuid4().hex}"
        self._check_common(req, cid)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must be equal to n (or unset)", param="best_of")
        if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
            raise APIError(400, "max_tokens 0 generates nothing: it is allowed with echo or "
                           "prompt_logprobs (to score the prompt)", param="max_tokens")
        self._check_size(_num_prompts(req.prompt), req.n)
        structured = structured_outputs_of(req)
        if not await self._check_grammar(structured, "structured_outputs"
                                         if req.structured_outputs is not None
                                         else "response_format", req, raw):
            return Response(status_code=499)
        prompts = await off_loop(text_size(req.prompt), self._completion_prompts, req.prompt)
        # echo with logprobs reports the prompt tokens' logprobs too (OpenAI's legacy API)
        echo_lps = req.logprobs if req.echo else None
        prompt_lps = max((k for k in (echo_lps, req.prompt_logprobs) if k is not None),
                         default=None)
        params = self._sampling_params(req, req.max_tokens, req.logprobs, prompt_lps,
                                       structured, request_retention(req))
        prep = self.prepared(prompts, params, req, raw)
        created = int(time.time())
        streams = await self._add_all(prep, cid, req, req.stream, arrival)
        if req.stream:
            return event_stream(self._completion_events(prep, streams, cid, created, model,
                                                        req, arrival),
                                lambda: self._abort_all(prep, streams))
        outputs = await self._collect(raw, prep, streams)
        if outputs is None:
            return Response(status_code=499)
        self._log_requests(req, prep, outputs, arrival)
        choices = []
        for p, out in enumerate(outputs):
            prompt_text = self._echo_text(prep.prompts[p], req) if req.echo else ""
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None:
                    ids, entries = list(c.token_ids), list(c.logprobs or ())
                    if req.echo:
                        ids = list(out.prompt_token_ids) + ids
                        entries = list(out.prompt_logprobs or ()) + entries
                    logprobs = self.logprob_format.completion_logprobs(
                        ids, entries, 0, req.logprobs)[0]
                choice = {"index": p * req.n + c.index, "text": prompt_text + c.text,
                          "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.logprob_format.vllm_prompt_logprobs(
                        out, req.prompt_logprobs)
                choices.append(choice)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created,
                             "model": model, "choices": choices, "usage": self._usage(outputs),
                             **(reports_field(outputs) if req.kv_cache_report else {}),
                             **transfer_field(outputs)})

    def _completion_prompts(self, prompt) -> list[dict[str, Any]]:
        out = []
        for item in _prompt_items(prompt):
            if isinstance(item, str):
                out.append({"prompt": item, "prompt_token_ids": self._encode(item)})
            elif item and isinstance(item[0], TextPart):  # server/documents.py
                out.append(tokenized(self.tokenizer, item, True, self.engine.max_model_len))
            else:
                out.append({"prompt_token_ids": list(item)})
        return out

    def _echo_text(self, prompt: dict[str, Any], req: CompletionRequest) -> str:
        """The prompt as echo returns it: the caller's text, or token ids decoded (as the
        completion is, honouring skip_special_tokens)."""
        if prompt.get("prompt") is not None:
            return prompt["prompt"]
        return self.tokenizer.decode(prompt["prompt_token_ids"],
                                     skip_special_tokens=req.skip_special_tokens)

    async def _completion_events(self, prep: Prepared, streams: list[RequestStream], cid: str,
                                 created: int, model: str, req: CompletionRequest,
                                 arrival: float = 0.0) -> AsyncIterator[str]:
        n = req.n
        opts = req.stream_options or StreamOptions()
        cursors = [[ChoiceCursor() for _ in range(n)] for _ in streams]
        last: list[RequestOutput | None] = [None] * len(streams)
        echo_texts = [self._echo_text(pr, req) if req.echo else "" for pr in prep.prompts]
        try:
            async for p, out in self._merge(streams):
                last[p] = out
                for c in out.outputs:
                    cur = cursors[p][c.index]
                    if cur.done:
                        continue
                    head, head_lp = "", None
                    if req.echo and not cur.echoed:
                        if req.logprobs is not None and out.prompt_logprobs is None:
                            continue  # a sibling ran ahead of the prompt's logprobs: wait
                        cur.echoed = True
                        head = echo_texts[p]
                        if req.logprobs is not None:
                            head_lp, cur.text_offset = self.logprob_format.completion_logprobs(
                                out.prompt_token_ids, out.prompt_logprobs, 0, req.logprobs)
                    delta = self._text_delta(c, cur, prep.stop_list)
                    lp = None
                    if req.logprobs is not None and c.logprobs is not None \
                            and len(c.token_ids) > cur.num_tokens:
                        lp, cur.text_offset = self.logprob_format.completion_logprobs(
                            c.token_ids[cur.num_tokens:], c.logprobs[cur.num_tokens:],
                            cur.text_offset)
                        cur.num_tokens = len(c.token_ids)
                    lp = join_logprobs(head_lp, lp)
                    finished = c.finish_reason is not None
                    if not head and not delta and lp is None and not finished:
                        continue
                    cur.done = finished
                    chunk = {"id": cid, "object": "text_completion", "created": created,
                             "model": model, "choices": [{
                                 "index": p * n + c.index, "text": head + delta,
                                 "logprobs": lp if req.logprobs is not None else None,
                                 "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}]}
                    if opts.continuous_usage_stats:
                        chunk["usage"] = self._choice_usage(len(out.prompt_token_ids), c)
                    yield sse(chunk)
            self._log_requests(req, prep, last, arrival)
            if opts.include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": self._usage(last)})
            if req.kv_cache_report:  # a last chunk of its own, as the usage has
                yield sse({"id": cid, "object": "text_completion", "created": created,
                           "model": model, "choices": [], **reports_field(last)})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are out: report in the stream, then end it
            err = engine_error(exc)
            yield sse(err.body())
            yield "data: [DONE]\n\n"
        finally:  # also on cancellation / GeneratorExit when the client went away
            self._abort_all(prep, streams)


def _prompt_items(prompt) -> list:
    """The prompts of a /v1/completions `prompt` field: a string, a list of strings, one token
    id list or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], (int, TextPart)):
        return [prompt]
    return list(prompt)


def _num_prompts(prompt) -> int:
    return len(_prompt_items(prompt))
