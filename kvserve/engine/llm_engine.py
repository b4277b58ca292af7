"""The engine loop: schedule -> run (plan, forward, sample) -> update, one step at a time.

`LLMEngine` holds the parts (worker/builder.py builds them: model, KV pool, worker), the
scheduler and the sampler. A request is validated by its InputProcessor
(engine/input_processor.py) before it is queued, so nothing malformed ever reaches a batched
step; each step goes to the workers as a message (worker/step.py) through the executor.
Should one request still raise
while it is sampled, detokenized or its output is built, it alone finishes with
finish_reason "error" (`RequestOutput.error` says why) and the others of the step go on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

import torch

from kvserve.config import EngineConfig
from kvserve.engine.audit import AUDIT_ID_PREFIX, Auditor
from kvserve.worker.builder import build_engine
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.kv_transfer import KVTransfer
from kvserve.engine.output_processor import OutputProcessor
from kvserve.worker.step import StepFailed, StepInput, StepOutput
from kvserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerHooks, StepUpdate
from kvserve.engine.stats import EngineStats
from kvserve.engine.swapping import build_swap_space
from kvserve.kv.bounded import BoundedKV, BoundedKVConfig
from kvserve.kv.events import KVEvent
from kvserve.kv.plan import StepPlan
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.kv.report import build_report
from kvserve.kv.tree_view import prefix_tree
from kvserve.outputs import RequestOutput
from kvserve.parallel.build import build_parallel_engine
from kvserve.request import Request, RequestStatus
from kvserve.sampling import SamplingParams
from kvserve.blend.audit import TWIN_ID_PREFIX
from kvserve.blend.blender import DOC_ID_PREFIX, build_blender
from kvserve.spec.build import build_speculator, drop_tokens
from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger("kvserve")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The model, the KV pool and its manager, the worker (or tensor parallelism's workers)
        parts = build_engine(config) if config.tensor_parallel_size == 1 \
            else build_parallel_engine(config)
        try:
            self._assemble(config, parts)
        except BaseException:
            parts.executor.shutdown()  # (tensor parallelism: no worker outlives a failed start)
            raise

    def _assemble(self, config: EngineConfig, parts) -> None:
        self.model, self.model_config, self.tokenizer = parts.model, parts.model_config, \
            parts.tokenizer
        self.dtype, self.kv_spec, self.page_groups = parts.dtype, parts.kv_spec, \
            parts.page_groups
        self.tensors, self.backend, self.tiers = parts.tensors, parts.backend, parts.tiers
        self.kv, self.runner, self.executor = parts.kv, parts.runner, parts.executor
        # Hit audits (engine/audit.py; None: off, the default); stats() has their counters.
        self.audit = Auditor(config, self.kv, self.executor,
                             self.kv_spec.layer_specs()[0].storage.dtype) \
            if config.kv_audit_rate > 0 else None
        self.scheduler = Scheduler(config, self.kv, SchedulerHooks(
            audit=self.audit, swap=build_swap_space(config, self.kv, self.tensors),
            spec=build_speculator(config.speculative_config, self.kv, self.model,
                                  parts.drafter),
            blend=build_blender(config.blend_config, self.kv, self.tokenizer),
            vocab_size=self.model_config.vocab_size))
        self.transfer = KVTransfer(config.kv_transfer_config, self.tiers)  # disaggregation
        self.inputs = InputProcessor(
            config, self.model_config, self.tokenizer, self.kv,
            self.tensors.quantized or self.tensors.dtype != self.dtype, self.backend)
        bound = self.inputs.bounded_kv
        if bound is not None:
            logger.warning("bounded KV cache on (lossy): %s, %d tokens, %d sink tokens",
                           bound.policy, bound.budget, bound.sink_tokens)
        self.eos_token_ids = self.inputs.eos_token_ids
        self._groups: dict[str, list[Request]] = {}
        self.outputs = OutputProcessor(self.tokenizer)
        self._streaming: set[str] = set()
        self._next_id = 0
        self._num_latencies = 0  # tier load latencies handed out by step_stats()

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
        """Finish queued tier saves, stop the tier threads and the executor's workers."""
        self.inputs.close()
        self.transfer.close()
        try:
            if self.tiers is not None:
                self._run_plan(self.scheduler.end_step())  # anything still planned
                self.scheduler.close_tiers()
                self.tiers.close()
                self.tiers = None
        finally:
            self.executor.shutdown()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    stream: bool = False, cache_salt: str | None = None,
                    priority: int = 0, bounded_kv: BoundedKVConfig | None = None,
                    tenant: str | None = None) -> str:
        """Validate and queue a request (n samples); returns its id. Raises ValueError if bad
        (engine/input_processor.py: nothing is queued or held then).

        A streaming request reports an output after every step that gave it a token; the others
        report once, when they finish. `bounded_kv` gives this request a bounded KV cache
        (lossy; kvserve.kv.bounded) in place of the engine's setting; `tenant` names whose
        cached blocks its are under tenant quotas (default: its cache salt).
        """
        rid = str(self._next_id) if request_id is None else request_id
        peer = self.transfer.peer_for(params) if params is not None else None
        children, grammar = self.inputs.make_requests(prompt, params, rid, arrival_time,
                                                      cache_salt, priority, bounded_kv)
        if request_id is None:
            self._next_id += 1
        elif request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        elif request_id.startswith((DOC_ID_PREFIX, TWIN_ID_PREFIX)):
            raise ValueError(f"request ids starting with {DOC_ID_PREFIX!r} or "
                             f"{TWIN_ID_PREFIX!r} are the engine's own (document reuse)")
        elif self.audit is not None and request_id.startswith(AUDIT_ID_PREFIX):
            raise ValueError(f"request ids starting with {AUDIT_ID_PREFIX!r} are the engine's "
                             "own (KV audits)")
        self._groups[rid] = children
        for child in children:
            child.tenant = tenant
        if stream:
            self._streaming.add(rid)
        for child in children:
            self.outputs.track(child, stream)
            self.scheduler.start_prefetch(child, peer)
        if grammar is not None and not grammar.done():
            self.inputs.compiling[rid] = (grammar, children)  # joins the queue once compiled
        else:
            self.scheduler.add_all(self.inputs.with_grammar(children, grammar))
        return rid

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar finished compiling; a compile that failed fails
        its request (the server compiles before adding, so that this is rare there)."""
        outputs = []
        for parent, children, grammar in self.inputs.take_compiled():
            if grammar.exception() is not None:
                outputs.append(self._fail_group(parent, children, grammar.exception()))
            else:
                self.scheduler.add_all(self.inputs.with_grammar(children, grammar))
        return outputs

    def explain_cache(self, prompt: PromptType, cache_salt: str | None = None,
                      prompt_logprobs: int | None = None, full: bool = True) -> dict:
        """What a request for `prompt` would find cached now, and why its first uncached token
        would miss (the cache report, kvserve/kv/report.py), without running it: nothing is
        queued, admitted or changed. Chunks on disk or in Redis count as a request would find
        them after its prefetch (present now: nothing is read or promoted). `full`: False
        for a report about the prompt's own tokens only (the server's ordinary callers)."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs,
                                kv_cache_report=True)
        [probe], _ = self.inputs.make_requests(prompt, params, "explain", None, cache_salt, 0,
                                               None)
        match = self.kv.match_after_prefetch(probe) if probe.skip_reason is None else \
            PrefixMatch([], block_size=self.kv.block_size)
        report = build_report(self.kv, probe, match, probe.skip_reason, full)
        return report.to_dict(self.tokenizer.decode)

    def _pin_probe(self, prompt: PromptType, cache_salt: str | None):
        [probe], _ = self.inputs.make_requests(prompt, SamplingParams(max_tokens=1), "pin",
                                               None, cache_salt, 0, None)
        num_tokens = len(probe.prompt_token_ids)
        probe.token_ids.append(0)  # so that every full block of the prompt is matchable
        return probe, num_tokens

    def pin_room(self, prompt: PromptType, cache_salt: str | None = None,
                 owner: str = "") -> int:
        """The blocks a pin of `prompt` takes; raises PinLimitError past `owner`'s
        --max-pinned-fraction or the --max-pinned-total-fraction, and ValueError for a prompt
        under one block."""
        probe, num_tokens = self._pin_probe(prompt, cache_salt)
        num_blocks = num_tokens // self.kv.block_size
        if num_blocks == 0:
            raise ValueError(f"the prompt ({num_tokens} tokens) is shorter than one KV block "
                             f"({self.kv.block_size} tokens): there is nothing to pin")
        self.kv.pins.check_seq_room(probe, num_blocks, owner)
        return num_blocks

    def pin_prefix(self, prompt: PromptType, cache_salt: str | None = None,
                   owner: str = "") -> dict | None:
        """Pin the prompt's cached blocks (kv/pins.py): the pin, or None when the device does
        not hold them all (run the prompt first). `owner`: who may list and release it besides
        the admin (the server's caller)."""
        probe, num_tokens = self._pin_probe(prompt, cache_salt)
        pin = self.scheduler.pin(probe, num_tokens, owner)
        return None if pin is None else pin.as_dict()

    def unpin(self, pin_id: str, owner: str | None = None) -> dict | None:
        """Release a pin; None if there is none of that id (made by `owner`, if given)."""
        pin = self.scheduler.unpin(pin_id, owner)
        return None if pin is None else pin.as_dict()

    def list_pins(self, owner: str | None = None) -> dict:
        """`owner`'s pins with its own count and budget, or (None) every pin with the
        server-wide count and cap (kv/pins.py: `Pins.summary`)."""
        return self.kv.pins.summary(owner)

    def prefix_tree(self, limit: int = 64) -> dict:
        """The largest shared prefixes of the device's cache (kv/tree_view.py), read-only."""
        index = self.kv.groups[0].index
        now = index.clock() if index.enabled else 0.0
        return prefix_tree(index.roots(), self.kv.block_size, now, self.tokenizer.decode, limit)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its samples) now and free its blocks; unknown ids are ignored."""
        # A request still waiting for its grammar is in no queue, but add_request started its
        # tier prefetch: the scheduler's finish (then kv.free) forgets that too.
        held = self.inputs.compiling.pop(request_id, None)
        if held is not None:
            held[0].cancel()  # its compile stops if no other request waits for it
        audit = self.audit.abort(request_id) if self.audit is not None else None
        if audit is not None:  # the running audit (what a failed step ran is aborted)
            self.scheduler.finish(audit, RequestStatus.FINISHED_ABORTED)
        for child in self._groups.pop(request_id, ()):
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self.outputs.forget(child.request_id)
        self._streaming.discard(request_id)
        if not self.scheduler.has_unfinished():
            self._forget_finished()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.inputs.compiling)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of requests that finished, and of streaming
        requests that got a token."""
        compiled = self._admit_compiled() if self.inputs.compiling else []
        batch = self._schedule()
        if not batch.requests:
            if batch.plan or batch.step.finished:
                self._execute(batch.step)  # its plan; the worker forgets the finished
            if self.inputs.compiling and not self.scheduler.has_unfinished():
                self.inputs.wait_compiling(0.05)
                return compiled + self._admit_compiled()
            if not self.scheduler.wait_for_prefetch(0.05):
                return compiled
            batch = self._schedule()  # only loads from disk/Redis were in the way
        started = time.perf_counter()
        out = self._execute(batch.step)  # its plan, its forward, its sampling
        swap = self.scheduler.swap
        if (swap is not None and swap.speeds is not None and batch.num_new_tokens
                and batch.num_new_tokens[0] > 1):
            # auto weighs the prefill speed (prefill chunks come first in a batch)
            swap.speeds.observe_prefill(sum(n for n in batch.num_new_tokens if n > 1),
                                        time.perf_counter() - started)
        update = self.scheduler.update_from_output(batch, out)
        if self.scheduler.spec is not None:
            self._time_speculation(batch, update, time.perf_counter() - started)
        # Bounded caches: pick the kept tokens and move the sequences onto fresh blocks now; the
        # KV moves in the plan handed out right after, with the write-through saves of the
        # chunks this forward completed (saved now, not a step later: an engine that goes idle
        # or shuts down next would never save them).
        moves = self.scheduler.bounded.compact(batch.requests, out.observed)
        plan = self.scheduler.end_step()  # (after the moves: their fresh blocks may evict)
        plan.compactions = moves
        self._run_plan(plan)
        outputs = compiled + self._outputs(update)
        if not self.scheduler.has_unfinished():
            self._forget_finished()  # idle next: no step would tell the worker
        return outputs

    def _time_speculation(self, batch: ScheduledBatch, update: StepUpdate,
                          seconds: float) -> None:
        """Tell the speculator how many tokens a decode-only step gave and how fast, with
        drafts or without (spec/speculator.py decides from it whether drafting pays)."""
        if not batch.has_prefill:  # a prefill row: the step's time is not a decode's
            self.scheduler.spec.observe_step(batch.num_drafted > 0, len(update.appended),
                                             seconds)

    def _forget_finished(self) -> None:
        finished = self.scheduler.take_finished()
        if finished:
            self.executor.execute(StepInput(finished=finished))

    def _outputs(self, update: StepUpdate) -> list[RequestOutput]:
        """Stop strings on the new tokens (the text has them now), then the outputs due: every
        streaming request that got a token, every request whose samples all finished, and a
        final error output for each request that failed in the step."""
        failed = update.failed
        # parent id -> its samples
        touched: dict[str, list[Request]] = {parent: self._groups[parent] for parent in failed}
        for parent in update.prefilled:
            touched.setdefault(parent, self._groups[parent])
        # Speculative decoding appends several tokens a step: one that a stop string ended
        # drops the tokens after it (by request id: how many of its tokens came after).
        stopped: dict[str, int] = {}
        behind = Counter(r.request_id for r, _, _ in update.appended) \
            if update.speculated else None  # by request: its tokens after this one
        for request, token, text in update.appended:
            parent = request.parent_id or request.request_id
            if parent not in touched:
                touched[parent] = self._groups[parent]
            num_output = None
            if behind is not None:
                behind[request.request_id] -= 1
                num_output = request.num_output_tokens - behind[request.request_id]
                if request.request_id in stopped:
                    stopped[request.request_id] += 1
                    continue
            if not text or parent in failed:
                continue
            try:
                if self.outputs.stop_string(request, token, num_output):  # (advances the text)
                    stopped[request.request_id] = 0
                    if request.finished:  # by length, on the token that hit the stop string
                        request.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            except Exception as exc:  # this request's own fault: it alone fails
                failed[parent] = exc
        for request_id, extra in stopped.items():
            if extra:
                drop_tokens(next(r for r, _, _ in update.appended
                                 if r.request_id == request_id), extra)
        outputs = []
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
            self._run_plan(self.scheduler.end_step())
            raise

    def _execute(self, step: StepInput) -> StepOutput:
        """One step through the executor. The plan's memory work lands even if the forward then
        fails (loaded blocks are in the prefix index already, and a later hit on them must find
        their KV); the chunks read for the tiers are stored either way; a failed load drops the
        prefix cache (blocks it names lack their KV) before the error goes on."""
        try:
            out = self.executor.execute(step)
        except StepFailed as failed:
            self.scheduler.save_chunks(failed.saved)
            self._store_swapped(failed.swapped)
            if failed.stage == "load":
                self.scheduler.reset_prefix_cache()
            raise failed.__cause__ from None
        self.scheduler.save_chunks(out.saved)
        self._store_swapped(out.swapped)
        return out

    def _run_plan(self, plan: StepPlan) -> None:
        if plan:
            self._execute(StepInput(plan=plan))

    def _store_swapped(self, swapped: dict[str, torch.Tensor]) -> None:
        if swapped:
            self.scheduler.swap.fill(swapped)

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
                self.scheduler.finish(c, RequestStatus.FINISHED_ERROR)
            c.status = RequestStatus.FINISHED_ERROR  # a sibling that had ended fails with it
        return self.outputs.error_output(parent_id, children, exc)

    def _output(self, parent_id: str) -> RequestOutput:
        children = self._groups[parent_id]
        if all(c.finished for c in children):
            del self._groups[parent_id]
            self._streaming.discard(parent_id)
        out = self.outputs.output(parent_id, children)
        if out.finished and children[0].sampling_params.kv_transfer_params:
            out.kv_transfer_params = self.transfer.answer(children[0].sampling_params)
        return out

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Debug check run by the tests after every step: queues, tables and pool agree."""
        self.scheduler.check_invariants()

    def state_sizes(self) -> dict[str, int]:
        """Sizes of the per-request state of the engine, its scheduler, KV manager and worker:
        all of it must be empty when no request is running (the server's memory diagnostics,
        server/debug_memory.py)."""
        kv = self.kv
        sizes = {
            "engine._groups": len(self._groups), "engine.outputs": len(self.outputs),
            "engine._streaming": len(self._streaming),
            "scheduler.running": len(self.scheduler.running),
            "scheduler.waiting": len(self.scheduler.waiting),
            "kv.block_tables": len(kv.block_tables),
            "kv._cursors": sum(len(g.cursors) for g in kv.groups),
            "worker.sampling": len(self.runner.sampling),
        }
        if kv.prefix_caching:  # every group's index together
            sizes["prefix.cached_blocks"] = sum(g.index.num_cached_blocks for g in kv.groups)
            sizes["prefix.heap"] = sum(len(g.index._heap) for g in kv.groups)
        return sizes

    def drain_kv_events(self) -> tuple[list[KVEvent], int]:
        """Blocks stored in / removed from the prefix index since the last drain, and how many
        records were dropped for want of room (kv/events.py)."""
        return self.scheduler.drain_kv_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache); running requests go on."""
        self.scheduler.reset_prefix_cache()

    @property
    def model_max_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def stats(self) -> EngineStats:
        """A snapshot of the gauges and counters every stats reader shares (see EngineStats)."""
        tiers = self.tiers
        return replace(self.scheduler.stats(), block_size=self.config.block_size,
                       num_gpu_blocks=self.kv.num_blocks, cache_dtype=self.config.kv_cache_dtype,
                       tier_stats=self.tier_stats(), tier_usage=tiers.usage() if tiers else {})

    def step_stats(self) -> EngineStats:
        """`stats()` with what happened since the previous call: the tiers' load latencies
        and the KV events (drained). The AsyncLLMEngine takes one after each step, and when it
        goes idle, for its stat loggers; as it drains, nothing else calls it."""
        latencies: list[tuple[str, float]] = []
        if self.tiers is not None:
            latencies, self._num_latencies = self.tiers.stats.latencies_since(
                self._num_latencies)
        events, dropped = self.drain_kv_events()
        return replace(self.stats(), tier_load_latencies=tuple(latencies),
                       kv_events=tuple(events), kv_events_dropped=dropped)

    def tier_stats(self) -> dict[str, dict]:
        """Bytes moved, faults and skipped saves of the storage tiers ({} without tiers)."""
        return self.tiers.stats.snapshot() if self.tiers is not None else {}
