"""What the endpoints share (`OpenAIServing`): the checks every request gets, its sampling
parameters, turning it into engine requests (added all or nothing), collecting or merging
their outputs (aborting them when the client leaves), usage, and the streaming cursors. The
endpoints derive from it: /v1/completions (serving_completion.py's OpenAIServingCompletion),
then /v1/chat/completions (serving_chat.py's OpenAIServingChat, which serves both); token
names and logprob objects are serving_logprobs.py's. The server reaches the engine only
through the AsyncLLMEngine's own methods.

Engine outputs are cumulative (full text and tokens so far); the streaming code keeps per-choice
cursors and sends only what is new. While a choice is running, trailing text that could be the
start of a stop string is held back (the engine cuts the text at a stop string, so text sent
too early could not be taken back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineQueueFullError,
                                         EngineStepError, RequestStream)
from kvserve.kv.retention import Retention
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvserve.server.auth import AccessPolicy, caller_of
from kvserve.server.serving_logprobs import LogprobFormatter
from kvserve.server.streaming import wait_for_disconnect
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tokenizer.tokenizer import holdback
from kvserve.utils.validation import check_text_fits, shorten

logger = logging.getLogger("kvserve")



def engine_error(exc: BaseException) -> APIError:
    """Map what adding or running a request raised to an HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    if isinstance(exc, EngineQueueFullError):
        return APIError(429, str(exc), code="rate_limit_exceeded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc))
    logger.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


@dataclass
class Prepared:
    """An endpoint's request, turned into engine inputs."""

    prompts: list[dict[str, Any]]
    params: SamplingParams
    stop_list: list[str]
    engine_ids: list[str] = field(default_factory=list)
    namespace: str | None = None  # the engine's cache_salt (kvserve/frontend/tenancy.py)
    tenant: str | None = None  # for tenant quotas (--kv-tenant-by api_key): the API key


@dataclass
class ChoiceCursor:
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    done: bool = False
    echoed: bool = False  # echo: the prompt went out (in this choice's first chunk)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: Sequence[str],
                 access: AccessPolicy | None = None) -> None:
        self.engine = engine
        self.model_names = list(served_model_names)
        self.tokenizer = engine.tokenizer
        self.logprob_format = LogprobFormatter(self.tokenizer)  # token names, logprobs
        self.request_log = None  # a kvserve.server.request_log.RequestLog (--request-log)
        self.access = access or AccessPolicy()  # keys, roles, isolation (server/auth.py)

    def prepared(self, prompts: list[dict[str, Any]], params: SamplingParams, req,
                 raw: Request) -> Prepared:
        """The engine inputs of the caller's request: its namespace and tenant, and a cache
        report about its own tokens unless the caller is the admin (server/auth.py)."""
        caller = caller_of(raw)
        params.kv_cache_report_full = caller.admin
        return Prepared(prompts, params, params.stop_list,
                        namespace=self.access.namespace(caller, req.cache_salt),
                        tenant=self.access.tenant(caller))

    # -- shared -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(404, f"The model `{shorten(model)}` does not exist.", param="model",
                           code="model_not_found")
        return model


    def _encode(self, text: str, add_special_tokens: bool = True,
                what: str = "the prompt") -> list[int]:
        """Tokenize, unless the text's length alone proves it cannot fit (then a 400 without
        tokenizing: see `check_text_fits`)."""
        try:
            check_text_fits(self.tokenizer, text, self.engine.max_model_len, what)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt" if what == "the prompt"
                           else "messages") from None
        return self.tokenizer.encode(text, add_special_tokens)

    def _check_size(self, num_prompts: int, n: int) -> None:
        """400 for a request that could never be admitted (before any tokenizing)."""
        what = f"this request ({num_prompts:,} prompts x n={n})" if num_prompts > 1 \
            else f"this request (n={n})"
        try:
            self.engine.check_request_size(num_prompts * n, what)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt" if num_prompts > 1 else "n") from None

    async def _check_grammar(self, structured: StructuredOutputsParams | None,
                             param: str, req, raw: Request) -> bool:
        """Compile the request's grammar before it is queued (in the compiler's processes,
        never on the event loop's thread nor the engine's), in the caller's tenant's turn: an
        invalid schema, regex or grammar, or one over a limit, is a 400 with the reason, and
        the engine then finds it in the cache. False if the client left meanwhile (the compile
        stops when nobody else waits for it)."""
        if structured is None:
            return True
        caller = caller_of(raw)
        tenant = ("key", caller.key) if caller.key is not None \
            else ("namespace", self.access.namespace(caller, req.cache_salt))
        future = await asyncio.to_thread(self.engine.submit_grammar, structured, tenant)
        compiled = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            await asyncio.wait((compiled, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not compiled.done():
                compiled.cancel()  # cancels `future`: this caller no longer waits
        if not compiled.done() or compiled.cancelled():
            return False
        exc = compiled.exception()
        if isinstance(exc, ValueError):
            raise APIError(400, str(exc), param=param) from None
        if exc is not None:
            raise engine_error(exc) from exc
        return True

    def _check_common(self, req: CompletionRequest | ChatCompletionRequest, rid: str) -> None:
        """Checks both endpoints share, before anything is tokenized."""
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        if req.priority and self.engine.config.eviction_policy != "priority":
            # as vLLM refuses a priority its scheduling policy does not use
            raise APIError(400, "priority has an effect only with --eviction-policy priority "
                           f"(this server uses {self.engine.config.eviction_policy!r})",
                           param="priority")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream (with "
                           "/v1/completions, echo with logprobs streams them)",
                           param="prompt_logprobs")
        if req.stream and (req.kv_transfer_params or {}).get("do_remote_decode"):
            raise APIError(400, "do_remote_decode answers once, with its kv_transfer_params: "
                           "send it with stream false", param="kv_transfer_params")
        if req.user is not None:  # what OpenAI keeps it for: telling abusers apart, in logs
            logger.info("request %s from user %s", rid, shorten(req.user))

    @staticmethod
    def _sampling_params(req, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         structured: StructuredOutputsParams | None = None,
                         retention: Retention | None = None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(req.logit_bias),
            structured_outputs=structured, kv_cache_report=req.kv_cache_report,
            kv_retention=retention, kv_transfer_params=req.kv_transfer_params)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from exc

    async def _add_all(self, prep: Prepared, base_id: str, req, streaming: bool,
                       arrival: float) -> list[RequestStream]:
        """Add one engine request per prompt, all in one go (the loop thread takes them in one
        batch); all or nothing."""
        prep.engine_ids = [f"{base_id}-{i}" for i in range(len(prep.prompts))]
        adds = [self.engine.add_request(rid, prompt, prep.params, stream=streaming,
                                        cache_salt=prep.namespace, priority=req.priority,
                                        arrival_time=arrival, tenant=prep.tenant)
                for rid, prompt in zip(prep.engine_ids, prep.prompts)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:  # cancelled: whatever was added goes
            for rid in prep.engine_ids:
                self.engine.abort(rid)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid in prep.engine_ids:
                self.engine.abort(rid)
            # the most telling error: the caller's (400) before the server's state (429, 503)
            errors.sort(key=lambda e: 0 if isinstance(e, (ValueError, TypeError)) else 1)
            raise engine_error(errors[0]) from errors[0]
        return list(results)

    def _abort_all(self, prep: Prepared, streams: Sequence[RequestStream]) -> None:
        for rid, rs in zip(prep.engine_ids, streams):
            if not rs.finished:
                self.engine.abort(rid)

    async def _collect(self, raw: Request, prep: Prepared,
                       streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Wait for every stream to finish, or for the client to go (then abort; None)."""
        async def final(rs: RequestStream) -> RequestOutput:
            while True:
                out = await rs.get()
                if out.finished:
                    return out

        tasks = [asyncio.ensure_future(final(rs)) for rs in streams]
        watcher = asyncio.ensure_future(wait_for_disconnect(raw))
        pending = set(tasks)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {watcher},
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    logger.debug("client disconnected: aborting %s", prep.engine_ids)
                    return None
                errors = [t.exception() for t in done if t.exception() is not None]
                if errors:
                    raise errors[0]
                pending -= done
            return [t.result() for t in tasks]
        except Exception as exc:
            raise engine_error(exc) from exc
        finally:
            watcher.cancel()
            for t in pending:
                t.cancel()
            self._abort_all(prep, streams)

    @staticmethod
    async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's position."""
        if len(streams) == 1:
            rs = streams[0]
            while not rs.finished:
                yield 0, await rs.get()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rs: RequestStream) -> None:
            try:
                while not rs.finished:
                    queue.put_nowait((i, await rs.get()))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.ensure_future(pump(i, rs)) for i, rs in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _log_requests(self, req, prep: Prepared, outputs: Sequence[RequestOutput | None],
                      arrival: float) -> None:
        """One --request-log line per finished engine request (none without the flag)."""
        if self.request_log is not None:
            self.request_log.log_finished(req, prep.prompts, prep.engine_ids, outputs, arrival,
                                          prep.namespace)

    @staticmethod
    def _usage(outputs: Sequence[RequestOutput | None]) -> dict[str, Any]:
        outs = [o for o in outputs if o is not None]
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        if drafted:  # speculative decoding (kvserve's extension, RequestMetrics' names)
            usage.update(num_draft_tokens=drafted, num_accepted_tokens=sum(
                o.metrics.num_accepted_tokens for o in outs))
        return usage

    @staticmethod
    def _choice_usage(num_prompt_tokens: int, c: CompletionOutput | None) -> dict[str, int]:
        """vLLM's continuous_usage_stats: one choice's prompt and its tokens so far."""
        completion = len(c.token_ids) if c is not None else 0
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": num_prompt_tokens + completion}

    def _text_delta(self, c: CompletionOutput, cur: ChoiceCursor,
                    stop_list: list[str]) -> str:
        """New text of a choice, holding back a possible stop-string prefix while it runs."""
        text = c.text
        end = len(text)
        if c.finish_reason is None and stop_list:
            end -= holdback(text, stop_list)
        if end <= cur.text_len:
            return ""
        delta = text[cur.text_len:end]
        cur.text_len = end
        return delta


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings ("50"); the engine checks
    the ids against the vocabulary."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids written as strings "
                           f"(\"50\"), got {shorten(key)}", param="logit_bias")
        out[int(key)] = value
    return out


