"""The engine loop: schedule -> run -> sample -> update, one step at a time.

`LLMEngine` holds the parts (engine/builder.py builds them: model, KV pool, worker), the
scheduler and the sampler. A request is validated by its InputProcessor
(engine/input_processor.py) before it is queued, so nothing malformed ever reaches a batched
step; each step goes to the workers as a message (engine/step.py) through the executor.
Should one request still raise
while it is sampled, detokenized or its output is built, it alone finishes with
finish_reason "error" (`RequestOutput.error` says why) and the others of the step go on.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from kvserve.config import EngineConfig
from kvserve.engine.builder import build_engine
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.step import StepFailed, StepInput, StepOutput
from kvserve.engine.scheduler import ScheduledBatch, Scheduler
from kvserve.engine.stats import EngineStats
from kvserve.kv.bounded import BoundedKV, BoundedKVConfig
from kvserve.kv.events import KVEvent
from kvserve.kv.plan import StepPlan
from kvserve.kv.spec import capacity_line, mla_saving_line
from kvserve.kv.tiers.stats import SOURCES
from kvserve.outputs import RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampler import Sampler, SamplingRow
from kvserve.sampling import SamplingParams
from kvserve.structured.grammar import GrammarCompiler, bitmask_words

logger = logging.getLogger("kvserve")


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
        self.inputs = InputProcessor(
            config, self.model_config, self.tokenizer, self.kv,
            self.tensors.quantized or self.tensors.dtype != self.dtype, self.backend)
        bound = self.inputs.bounded_kv
        if bound is not None:
            logger.warning("bounded KV cache on (lossy): %s, %d tokens, %d sink tokens",
                           bound.policy, bound.budget, bound.sink_tokens)
        self.sampler = Sampler(seed=config.seed)
        self.eos_token_ids = self.inputs.eos_token_ids
        self._groups: dict[str, list[Request]] = {}
        self.outputs = OutputProcessor(self.tokenizer)
        self._streaming: set[str] = set()
        # Requests whose grammar is still compiling (on the compiler's thread): parent id ->
        # (the compile, its samples). They join the scheduler once it is done; the batch never
        # waits for a compile.
        self._compiling: dict[str, tuple[Future, list[Request]]] = {}
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
    def bounded_kv(self) -> BoundedKV | None:
        """The engine-wide bounded KV cache (None: every request keeps its whole KV unless it
        asks for its own)."""
        return self.inputs.bounded_kv

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammar compiler (InputProcessor.grammars)."""
        return self.inputs.grammars

    def shutdown(self) -> None:
        """Finish queued tier saves and stop the tier threads."""
        self.inputs.close()
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
        """Validate and queue a request (n samples); returns its id. Raises ValueError if bad
        (engine/input_processor.py: nothing is queued or held then).

        A streaming request reports an output after every step that gave it a token; the others
        report once, when they finish. `bounded_kv` gives this request a bounded KV cache
        (lossy; kvserve.kv.bounded) in place of the engine's setting.
        """
        rid = str(self._next_id) if request_id is None else request_id
        children, grammar = self.inputs.make_requests(prompt, params, rid, arrival_time,
                                                      cache_salt, priority, bounded_kv)
        if request_id is None:
            self._next_id += 1
        elif request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._groups[rid] = children
        if stream:
            self._streaming.add(rid)
        for child in children:
            self.outputs.track(child, stream)
            self.kv.start_prefetch(child)
        if grammar is not None and not grammar.done():
            self._compiling[rid] = (grammar, children)
        else:
            self._schedule_children(children, grammar)
        return rid

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

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its samples) now and free its blocks; unknown ids are ignored."""
        # A request still waiting for its grammar is in no queue, but add_request started its
        # tier prefetch: _finish (the scheduler's finish, then kv.free) forgets that too.
        self._compiling.pop(request_id, None)
        for child in self._groups.pop(request_id, ()):
            if not child.finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
            self.outputs.forget(child.request_id)
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
        moves = self.scheduler.bounded.compact(batch.requests, out.observed)
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
        "error", blocks freed) and return its final output, which carries the error
        (`_output` may have dropped the group already)."""
        logger.error("request %s failed inside the step; it is stopped, the others go on",
                     parent_id, exc_info=exc)
        self._groups.pop(parent_id, None)
        self._streaming.discard(parent_id)
        for c in children:
            if not c.finished:
                self._finish(c, RequestStatus.FINISHED_ERROR)
            c.status = RequestStatus.FINISHED_ERROR  # a sibling that had ended fails with it
        return self.outputs.error_output(parent_id, children, exc)

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
        if self.outputs.stop_string(request, token):  # (also advances the request's text)
            return RequestStatus.FINISHED_STOPPED
        if n_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        request.finished_time = time.time()

    def _output(self, parent_id: str) -> RequestOutput:
        children = self._groups[parent_id]
        if all(c.finished for c in children):
            del self._groups[parent_id]
            self._streaming.discard(parent_id)
        return self.outputs.output(parent_id, children)

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
            num_evicted_blocks=self.kv.num_evicted_blocks,
            hit_tokens={source: self.kv.hit_tokens[source] for source in SOURCES})

    def tier_stats(self) -> dict[str, dict]:
        """Bytes moved, faults and skipped saves of the storage tiers ({} without tiers)."""
        return self.tiers.stats.snapshot() if self.tiers is not None else {}


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
