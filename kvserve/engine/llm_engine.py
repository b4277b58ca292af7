"""The engine loop: schedule -> run -> sample -> update, one step at a time.

`LLMEngine` owns every piece (model, KV pool, scheduler, sampler, tokenizer) and is the single
place where a request is validated, so that nothing malformed ever reaches a batched step: an
invalid request raises before it is queued, and holds no blocks. Should one request still raise
while it is sampled, detokenized or its output is built, it alone finishes with
finish_reason "error" (`RequestOutput.error` says why) and the others of the step go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Union

import torch

from kvserve.config import EngineConfig
from kvserve.engine.bounded_kv import compact_bounded
from kvserve.engine.builder import build_engine
from kvserve.engine.step import StepFailed, StepInput, StepOutput
from kvserve.engine.scheduler import ScheduledBatch, Scheduler
from kvserve.engine.stats import EngineStats
from kvserve.kv.bounded import (
    ATTENTION_POLICIES,
    BoundedKV,
    BoundedKVConfig,
    peak_tokens,
    resolve_bounded_kv,
)
from kvserve.kv.events import KVEvent
from kvserve.kv.plan import StepPlan
from kvserve.kv.spec import capacity_line, mla_saving_line
from kvserve.kv.tiers.stats import SOURCES
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampler import Sampler, SamplingRow
from kvserve.sampling import SamplingParams
from kvserve.structured.grammar import GrammarCompiler, bitmask_words
from kvserve.tokenizer import IncrementalDetokenizer, find_stop
from kvserve.validation import (
    check_cache_salt,
    check_text_fits,
    check_token_ids,
    check_utf8,
    shorten,
)

logger = logging.getLogger("kvserve")

# A prompt is text, {"prompt": text}, or {"prompt_token_ids": [...]} (vLLM's TokensPrompt).
PromptType = Union[str, Mapping[str, Any]]


@dataclass
class _Detok:
    """Per-sample text state: the incremental decoder and the text cut at a stop string."""

    decoder: IncrementalDetokenizer
    text: str = ""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine(config)  # the model, the KV pool and its manager, the worker
        self.model, self.model_config, self.tokenizer = parts.model, parts.model_config, \
            parts.tokenizer
        self.dtype, self.kv_spec, self.page_groups = parts.dtype, parts.kv_spec, \
            parts.page_groups
        self.tensors, self.backend, self.tiers = parts.tensors, parts.backend, parts.tiers
        self.kv, self.runner, self.executor = parts.kv, parts.runner, parts.executor
        num_blocks = self.kv.num_blocks
        self.scheduler = Scheduler(config, self.kv)
        # The engine-wide bounded KV cache (lossy, opt-in), checked now so a bad one fails at
        # start-up; a request may ask for its own (add_request's bounded_kv).
        self.bounded_kv: BoundedKV | None = None
        if config.bounded_kv_policy is not None:
            self.bounded_kv = self._resolve_bounded_kv(BoundedKVConfig(
                config.bounded_kv_policy, config.bounded_kv_budget,
                config.bounded_kv_sink_tokens, config.bounded_kv_observation_window))
            logger.warning("bounded KV cache on (lossy): %s, %d tokens, %d sink tokens",
                           self.bounded_kv.policy, self.bounded_kv.budget,
                           self.bounded_kv.sink_tokens)
        self.sampler = Sampler(seed=config.seed)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._groups: dict[str, list[Request]] = {}
        self._detok: dict[str, _Detok] = {}
        self._streaming: set[str] = set()
        # Requests whose grammar is still compiling (on the compiler's thread): parent id ->
        # (the compile, its samples). They join the scheduler once it is done; the batch never
        # waits for a compile.
        self._compiling: dict[str, tuple[Future, list[Request]]] = {}
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._next_id = 0
        logger.info(capacity_line(num_blocks, config.block_size, config.max_model_len,
                                  self.kv.final_blocks(config.max_model_len),
                                  self.kv.num_groups))
        mla = self.model_config.mla
        if mla is not None:
            logger.info(mla_saving_line(self.kv_spec.layer_specs()[0],
                                        self.model_config.num_attention_heads, mla.qk_head_dim,
                                        mla.v_head_dim))

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler, made on first use (building the tokenizer's
        table takes a moment; an engine that never sees a grammar never pays it). Thread-safe:
        the server compiles from worker threads, off the engine loop."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 sorted(self.eos_token_ids))
            return self._grammars

    def shutdown(self) -> None:
        """Finish queued tier saves and stop the tier threads."""
        if self._grammars is not None:
            self._grammars.close()
        if self.tiers is not None:
            self._run_plan(self.kv.end_step())  # anything still planned for the tiers
            self.kv.tiers.close()
            self.tiers.close()
            self.tiers = None

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    stream: bool = False, cache_salt: str | None = None,
                    priority: int = 0, bounded_kv: BoundedKVConfig | None = None) -> str:
        """Validate and queue a request (n samples); returns its id. Raises ValueError if bad.

        A streaming request reports an output after every step that gave it a token; the others
        report once, when they finish. `bounded_kv` gives this request a bounded KV cache
        (lossy; kvserve.kv.bounded) in place of the engine's setting.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if cache_salt is None and isinstance(prompt, Mapping):
            cache_salt = prompt.get("cache_salt")  # vLLM's TextPrompt / TokensPrompt field
        check_cache_salt(cache_salt)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {shorten(priority)}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        check_token_ids("logit_bias token ids", list(params.logit_bias or ()),
                        self.model_config.vocab_size)
        text, token_ids = self._tokenize(prompt)
        grammar: Future | None = None
        if params.structured_outputs is not None:
            grammar = self.grammars.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        bound = self._resolve_bounded_kv(bounded_kv) if bounded_kv is not None \
            else self.bounded_kv
        blocks = self._blocks_needed(len(token_ids), max_tokens, bound)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {blocks} KV blocks ({len(token_ids)} prompt + {max_tokens} "
                f"new tokens) but the KV pool has only {self.kv.num_blocks} blocks "
                f"({self.kv.num_blocks * self.config.block_size} tokens); raise "
                "kv_cache_memory_bytes or lower max_tokens")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time() if arrival_time is None else arrival_time
        children = [Request(request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                            prompt_token_ids=token_ids, sampling_params=params,
                            max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                            arrival_time=arrival, prompt=text, index=i, parent_id=request_id,
                            cache_salt=cache_salt, priority=priority, bounded_kv=bound)
                    for i in range(params.n)]
        self._groups[request_id] = children
        if stream:
            self._streaming.add(request_id)
        for child in children:
            # Text is decoded token by token only when someone looks at it before the end (stop
            # strings, streaming); otherwise once, at the end, off the per-token path.
            if params.detokenize and (stream or params.stop_list):
                self._detok[child.request_id] = _Detok(IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.skip_special_tokens))
            self.kv.start_prefetch(child)
        if grammar is not None and not grammar.done():
            self._compiling[request_id] = (grammar, children)
        else:
            self._schedule_children(children, grammar)
        return request_id

    def _schedule_children(self, children: list[Request], grammar: Future | None) -> None:
        """Queue the samples of a request, each with its own matcher over the compiled
        grammar when it has one."""
        for child in children:
            if grammar is not None:
                child.grammar = self.grammars.new_state(grammar.result())
            self.scheduler.add(child)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar finished compiling; a compile that failed fails
        its request (the server compiles before adding, so that this is rare there)."""
        outputs = []
        for parent, (grammar, children) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[parent]
            if grammar.exception() is not None:
                outputs.append(self._fail_group(parent, children, grammar.exception()))
            else:
                self._schedule_children(children, grammar)
        return outputs

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_utf8("the prompt", prompt)
            check_text_fits(self.tokenizer, prompt, self.model_max_len)
            text, ids = prompt, (self.tokenizer.encode(prompt) if prompt else [])
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of integers")
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(f"prompt must be a string, got {type(text).__name__}")
                check_utf8("the prompt", text)
            ids = list(ids)
            check_token_ids("token ids", ids, self.model_config.vocab_size)
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        else:
            raise ValueError("a prompt must be a string, {'prompt': str} or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        return text, ids

    def _resolve_bounded_kv(self, config: BoundedKVConfig) -> BoundedKV:
        if not isinstance(config, BoundedKVConfig):
            raise ValueError(f"bounded_kv must be a BoundedKVConfig, got "
                             f"{type(config).__name__}")
        if self.model_config.mla is not None:
            raise ValueError("a bounded KV cache is not supported for MLA models (their latent "
                             "cache is compressed already)")
        if self.tensors.quantized or self.tensors.dtype != self.dtype:
            raise ValueError("a bounded KV cache needs the KV cache in the model's own dtype "
                             f"(kv_cache_dtype=auto), got kv_cache_dtype="
                             f"{self.config.kv_cache_dtype!r}: compaction and the attention "
                             "weights of SnapKV/H2O read the cache unquantized")
        bound = resolve_bounded_kv(config, self.model_max_len, self.model_config.layer_windows)
        if bound.policy in ATTENTION_POLICIES and not self.backend.observes_attention:
            raise ValueError(f"bounded KV policy {bound.policy} selects by attention weights, "
                             "which only the torch attention backend computes (this engine "
                             f"runs {self.config.attention_backend})")
        return bound

    def _blocks_needed(self, prompt_len: int, max_tokens: int, bound: BoundedKV | None) -> int:
        """The most blocks a request can hold at once: what the manager counts (all its tokens,
        or its window's), or for a bounded cache its prompt, or budget + one block plus the
        budget's fresh blocks while it compacts. Its tokens are those whose KV is ever
        computed: the last sampled token never is (the simulator counts the same)."""
        total = prompt_len + max(max_tokens - 1, 0)
        if bound is None:
            return self.kv.peak_blocks(prompt_len, total)
        grown = peak_tokens(prompt_len, total, bound, self.config.block_size)
        compacting = self.kv.blocks_for_tokens(bound.budget) if total >= bound.budget else 0
        return self.kv.blocks_for_tokens(grown) + compacting

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.config.max_model_len
        assert limit is not None
        if params.max_tokens == 0:  # prefill only: the prompt may fill the whole context
            if prompt_len > limit:
                raise ValueError(f"the prompt has {prompt_len} tokens, but max_model_len is "
                                 f"{limit}")
            return 0
        if prompt_len >= limit:
            raise ValueError(f"the prompt has {prompt_len} tokens, but max_model_len is {limit}: "
                             "no room to generate")
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens, but "
                             f"{prompt_len} prompt tokens + {params.max_tokens} max_tokens "
                             f"= {prompt_len + params.max_tokens} were requested")
        return params.max_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its samples) now and free its blocks; unknown ids are ignored."""
        # A request still waiting for its grammar is in no queue, but add_request started its
        # tier prefetch: _finish (the scheduler's finish, then kv.free) forgets that too.
        self._compiling.pop(request_id, None)
        for child in self._groups.pop(request_id, ()):
            if not child.finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
            self._detok.pop(child.request_id, None)
        self._streaming.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of requests that finished, and of streaming
        requests that got a token."""
        compiled = self._admit_compiled() if self._compiling else []
        batch = self._schedule()
        if not batch.requests:
            self._run_plan(batch.plan)
            if self._compiling and not self.scheduler.has_unfinished():
                _wait_any([f for f, _ in self._compiling.values()], 0.05)
                return compiled + self._admit_compiled()
            if not self.kv.wait_for_prefetch(0.05):
                return compiled
            batch = self._schedule()  # only loads from disk/Redis were in the way
        out = self._execute(batch.step)  # its plan, then its forward
        self.scheduler.update(batch)
        # Bounded caches: pick the kept tokens and move the sequences onto fresh blocks now; the
        # KV moves in the plan handed out right after, with the write-through saves of the
        # chunks this forward completed (saved now, not a step later: an engine that goes idle
        # or shuts down next would never save them).
        moves = compact_bounded(batch.requests, self.kv, out.observed)
        plan = self.kv.end_step()  # (after the moves: their fresh blocks may evict and save)
        plan.compactions = moves
        self._run_plan(plan)
        failed = self._record_prompt_logprobs(batch, out)  # parent id -> what it raised
        now = time.time()
        prefilled = self._finish_prefill_only(batch, failed, now)
        if not out.sampled and not failed and not prefilled:
            return compiled
        rows = [batch.requests[i] for i in out.sampled]
        tokens, all_logprobs, sample_failed = self._sample(out.logits, rows)
        failed = {**sample_failed, **failed}
        # parent id -> its samples
        touched: dict[str, list[Request]] = {parent: self._groups[parent] for parent in failed}
        for parent in prefilled:
            touched.setdefault(parent, self._groups[parent])
        for request, token, logprobs in zip(rows, tokens, all_logprobs):
            parent = request.parent_id or request.request_id
            if parent not in touched:
                touched[parent] = self._groups[parent]
            if parent in failed:
                continue
            try:
                self._append_token(request, token, logprobs, now)
            except Exception as exc:  # this request's own fault: it alone fails
                failed[parent] = exc
        outputs = compiled
        for parent, children in touched.items():
            if parent in failed or not (parent in self._streaming
                                        or all(c.finished for c in children)):
                continue
            try:
                outputs.append(self._output(parent))
            except Exception as exc:
                failed[parent] = exc
        outputs.extend(self._fail_group(parent, touched[parent], exc)
                       for parent, exc in failed.items())
        return outputs

    def _schedule(self) -> ScheduledBatch:
        """Schedule a batch. A schedule that raises part-way still hands out what its
        admissions planned (run at once), so that nothing stale is left for the next step."""
        try:
            return self.scheduler.schedule()
        except Exception:
            self._run_plan(self.kv.end_step())
            raise

    def _execute(self, step: StepInput) -> StepOutput:
        """One step through the executor. The plan's memory work lands even if the forward then
        fails (loaded blocks are in the prefix index already, and a later hit on them must find
        their KV); the chunks read for the tiers are stored either way; a failed load drops the
        prefix cache (blocks it names lack their KV) before the error goes on."""
        try:
            out = self.executor.execute(step)
        except StepFailed as failed:
            self._store_saved(failed.saved)
            if failed.stage == "load":
                self.kv.reset_prefix_cache()
            raise failed.__cause__ from None
        self._store_saved(out.saved)
        return out

    def _run_plan(self, plan: StepPlan) -> None:
        if plan:
            self._execute(StepInput(plan=plan))

    def _store_saved(self, saved: list[tuple[int, torch.Tensor]]) -> None:
        """Best-effort: a chunk that is not saved is recomputed later."""
        for chunk_hash, data in saved:
            try:
                self.kv.tiers.save(chunk_hash, data)
            except Exception:
                logger.exception("saving chunk %x to the tiers failed; it is skipped",
                                 chunk_hash)

    def _sample(self, logits: torch.Tensor, rows: list[Request]
                ) -> tuple[list[int | None], list[dict[int, float] | None],
                           dict[str, Exception]]:
        """Sample every row in one batch; should that raise, sample row by row, so that only
        the requests whose own row raises fail (their token is None; errors by parent id).
        The retry may draw again from generators the failed batch already advanced: greedy
        neighbours are unaffected, random ones stay valid samples."""
        if not rows:
            return [], [], {}
        try:
            result = self.sampler(logits, *_sampling_rows(rows, logits.shape[1]))
            return result.token_ids, result.logprobs, {}
        except Exception:
            logger.exception("batched sampling failed; sampling row by row to isolate it")
        tokens: list[int | None] = []
        logprobs: list[dict[int, float] | None] = []
        failed: dict[str, Exception] = {}
        for i, request in enumerate(rows):
            try:
                one = self.sampler(logits[i:i + 1], *_sampling_rows([request], logits.shape[1]))
                tokens.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            except Exception as exc:
                tokens.append(None)
                logprobs.append(None)
                failed[request.parent_id or request.request_id] = exc
        return tokens, logprobs, failed

    def _record_prompt_logprobs(self, batch: ScheduledBatch, out: StepOutput
                                ) -> dict[str, Exception]:
        """Append to each request the logprobs of the prompt tokens this step's logits
        predicted (the scheduler asked only for the ones not recorded yet, so a prompt recomputed
        after a preemption neither repeats nor loses an entry). Request by request, so that one
        that raises fails alone: returns what raised, by parent id."""
        failed: dict[str, Exception] = {}
        at = 0
        for span in out.prompt_spans:
            request = batch.requests[span.index]
            logits = out.prompt_logits[at:at + span.count]
            at += span.count
            try:
                assert len(request.prompt_logprobs) == span.first_token, \
                    "prompt logprobs out of step"
                tokens = request.prompt_token_ids[span.first_token:span.first_token + span.count]
                entries, ranks = self.sampler.token_logprobs(
                    logits, tokens, [request.sampling_params.prompt_logprobs] * span.count)
                request.prompt_logprobs.extend(entries)
                request.prompt_logprob_ranks.extend(ranks)
            except Exception as exc:
                failed[request.parent_id or request.request_id] = exc
        return failed

    def _finish_prefill_only(self, batch: ScheduledBatch, failed: dict[str, Exception],
                             now: float) -> list[str]:
        """Finish ("length") the prefill-only requests (max_tokens 0) whose prompt this step
        completed; their blocks go back to the pool (the full ones stay in the prefix cache).
        Their output is ready now, which is what their first/last token times record. Returns
        their parent ids."""
        parents = []
        for request in batch.requests:
            parent = request.parent_id or request.request_id
            if not request.prefill_only or request.finished or parent in failed \
                    or request.num_computed_tokens < request.num_tokens:
                continue
            request.first_token_time = request.last_token_time = now
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            parents.append(parent)
        return parents

    def _fail_group(self, parent_id: str, children: list[Request],
                    exc: Exception) -> RequestOutput:
        """Finish every sample of a request that raised inside the step (finish_reason
        "error", blocks freed) and return its final output, which carries the error. Built
        from the counters alone, since its text is what may have failed (`_output` may have
        dropped the group already)."""
        logger.error("request %s failed inside the step; it is stopped, the others go on",
                     parent_id, exc_info=exc)
        self._groups.pop(parent_id, None)
        self._streaming.discard(parent_id)
        for c in children:
            self._detok.pop(c.request_id, None)
            if not c.finished:
                self._finish(c, RequestStatus.FINISHED_ERROR)
            c.status = RequestStatus.FINISHED_ERROR  # a sibling that had ended fails with it
        first = children[0]
        return RequestOutput(
            request_id=parent_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[CompletionOutput(index=c.index, text="", token_ids=c.output_token_ids,
                                      cumulative_logprob=None, logprobs=None,
                                      finish_reason=RequestStatus.FINISHED_ERROR.value)
                     for c in children],
            finished=True, metrics=_group_metrics(children, True),
            num_cached_tokens=first.num_cached_tokens,
            error=shorten(f"{type(exc).__name__}: {exc}", 200))

    def _append_token(self, request: Request, token: int, logprobs: dict[int, float] | None,
                      now: float) -> None:
        request.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token]
        if request.grammar is not None and not request.grammar.accept(token):
            raise ValueError(f"token {token} is not allowed by the request's grammar")
        status = self._check_stop(request, token)
        if status is None and request.grammar is not None and request.grammar.terminated:
            status = RequestStatus.FINISHED_STOPPED  # the grammar has ended (its stop token)
        if status is not None:
            self._finish(request, status)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        detok = self._detok.get(request.request_id)
        if detok is not None:
            delta = detok.decoder.add(token)
            detok.text += delta
            if params.stop_list and n_out >= params.min_tokens:
                at = find_stop(detok.text, len(delta), params.stop_list)
                if at is not None:
                    stop = next(s for s in params.stop_list if detok.text.startswith(s, at))
                    cut = at + len(stop) if params.include_stop_str_in_output else at
                    detok.text = detok.text[:cut]
                    request.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if n_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        request.finished_time = time.time()

    # -- outputs ----------------------------------------------------------------------------
    def _output(self, parent_id: str) -> RequestOutput:
        children = self._groups[parent_id]
        finished = all(c.finished for c in children)
        if finished:
            del self._groups[parent_id]
            self._streaming.discard(parent_id)
        completions = []
        for c in children:
            detok = self._detok.pop(c.request_id, None) if finished else \
                self._detok.get(c.request_id)
            if detok is not None:
                if finished and c.stop_reason is None:  # text ended mid-character: emit the rest
                    detok.text += detok.decoder.flush()
                text = detok.text
            elif c.sampling_params.detokenize:
                text = self.tokenizer.decode(c.output_token_ids,
                                             skip_special_tokens=c.sampling_params.skip_special_tokens)
            else:
                text = ""
            wants_logprobs = c.sampling_params.logprobs is not None
            completions.append(CompletionOutput(
                index=c.index, text=text, token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if wants_logprobs else None,
                logprobs=list(c.output_logprobs) if wants_logprobs else None,
                finish_reason=c.status.value if c.finished else None,
                stop_reason=c.stop_reason))
        first = children[0]
        prompt_logprobs = _prompt_logprobs(first)
        return RequestOutput(request_id=parent_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=_group_metrics(children, finished),
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs,
                             prompt_logprob_ranks=None if prompt_logprobs is None
                             else list(first.prompt_logprob_ranks))

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Debug check run by the tests after every step: queues, tables and pool agree."""
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        assert len({r.request_id for r in live}) == len(live), "a request is queued twice"
        for r in self.scheduler.running:
            assert r.status is RequestStatus.RUNNING
        for r in self.scheduler.waiting:
            assert r.status is RequestStatus.WAITING
            assert r.request_id not in self.kv.block_tables, "a waiting request holds blocks"
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        self.kv.check_invariants(live)

    def drain_kv_events(self) -> tuple[list[KVEvent], int]:
        """Blocks stored in / removed from the prefix index since the last drain, and how many
        records were dropped for want of room (kv/events.py)."""
        return self.kv.drain_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache); running requests go on."""
        self.kv.reset_prefix_cache()

    @property
    def model_max_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def stats(self) -> EngineStats:
        """A snapshot of the gauges and counters every stats reader shares (see EngineStats)."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_evicted_blocks=self.kv.index.num_evicted_blocks,
            hit_tokens={source: self.kv.hit_tokens[source] for source in SOURCES})

    def tier_stats(self) -> dict[str, dict]:
        """Bytes moved, faults and skipped saves of the storage tiers ({} without tiers)."""
        return self.tiers.stats.snapshot() if self.tiers is not None else {}


def _prompt_logprobs(first: Request) -> list[dict[int, float] | None] | None:
    """vLLM's RequestOutput.prompt_logprobs, once every prompt token has its entry (a streamed
    output of a sibling sample can come before the first sample's prefill ends)."""
    if len(first.prompt_logprobs) < len(first.prompt_token_ids):
        return None
    return list(first.prompt_logprobs)


def _sampling_rows(requests: list[Request], vocab: int
                   ) -> tuple[list[SamplingRow], torch.Tensor | None]:
    """The sampler's rows, and the step's grammar bitmask: the requests with a grammar fill one
    row each of one int32 tensor, in batch order (`SamplingRow.bitmask_row`), which the sampler
    applies as it is; the others have none and pay nothing."""
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    bitmask = None
    if constrained:
        bitmask = torch.full((len(constrained), bitmask_words(vocab)), -1, dtype=torch.int32)
        for j, i in enumerate(constrained):
            requests[i].grammar.fill_bitmask(bitmask, j)
    rows_of = {i: j for j, i in enumerate(constrained)}
    return [SamplingRow(r.sampling_params, r.output_token_ids, r.prompt_token_ids, r.generator,
                        r.eos_token_ids, rows_of.get(i)) for i, r in enumerate(requests)], bitmask


def _wait_any(futures: list[Future], timeout: float) -> None:
    wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)


def _group_metrics(children: list[Request], finished: bool) -> RequestMetrics:
    """The metrics of a request from those of its samples."""
    first = children[0]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min((c.first_token_time for c in children
                              if c.first_token_time is not None), default=None),
        last_token_time=max((c.last_token_time for c in children
                             if c.last_token_time is not None), default=None),
        finished_time=max((c.finished_time or 0.0 for c in children), default=None)
        if finished else None,
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(c.num_preemptions for c in children))
