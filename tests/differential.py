"""Differential testing of the engine: one random workload, run twice through the public engine
API with a feature on and off, must give the same greedy tokens and the same logprobs.

Caching features (prefix caching, storage tiers) are pure optimisations: whatever they serve
from memory, disk or Redis must be what the engine would have computed. A test that compares
against a reference model on a few prompts misses the rare interleavings where a cache serves KV
that is not written yet (a copy-on-write copy or a tier load landing in the wrong order), so here
a generator builds many small workloads, rich in exactly those interleavings, and compares whole
runs. Everything goes through `LLMEngine.add_request` / `step` / `abort_request` and public
stats, so that the comparison survives any redesign of the KV internals.

The generator draws every choice through a `Chooser` (hypothesis behind it, in
tests/test_differential.py: shrinkable, seeded). A long soak is that test with more examples:
KVSERVE_DIFFERENTIAL_SCALE=N runs N times as many.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.stats import EngineStats

import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvserve import LLM, SamplingParams

VOCAB = 512  # conftest's transformers checkpoints
MAX_MODEL_LEN = 128
LOGPROB_TOL = 1e-4  # fp32: batching noise is ~1e-6; the defects this guards against are ~1e-2
TIER_COMBOS = ("host", "host+disk", "host+redis", "host+disk+redis")


# -- choices ---------------------------------------------------------------------------------
class Chooser(Protocol):
    """The few kinds of choice the generator makes (hypothesis behind it: DrawChooser)."""

    def integer(self, lo: int, hi: int) -> int: ...  # inclusive

    def pick(self, options: Sequence[Any]) -> Any: ...

    def coin(self, p: float) -> bool: ...


class DrawChooser:
    """Choices drawn by hypothesis (`draw` of an @st.composite), so failures shrink."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.draw = draw
        self.st = st

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def pick(self, options: Sequence[Any]) -> Any:
        return self.draw(self.st.sampled_from(list(options)))

    def coin(self, p: float) -> bool:
        # A weighted coin that still shrinks towards False.
        return self.draw(self.st.integers(0, 99)) < round(p * 100)


# -- workloads -------------------------------------------------------------------------------
@dataclass
class Req:
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    abort_after: int | None = None  # steps after it was added; its output is not compared


@dataclass
class Phase:
    """Requests added together (so they are scheduled in the same step, in this order), then
    `steps` engine steps, or until the engine is idle when `steps` is None."""

    adds: list[Req]
    steps: int | None = None
    reset_prefix_cache: bool = False  # before the adds (public LLM API)


@dataclass
class Workload:
    block_size: int
    chunk_size: int  # tokens per tier chunk
    pool_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    write_policy: str
    phases: list[Phase] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(p.adds) for p in self.phases)

    def describe(self) -> str:
        """A compact listing for failure messages (token ids shortened): what ran, in what
        order, under which limits."""
        lines = [f"block {self.block_size}, chunk {self.chunk_size}, pool {self.pool_blocks} "
                 f"blocks, budget {self.max_num_batched_tokens}, seqs {self.max_num_seqs}, "
                 f"{self.write_policy}"]
        for i, p in enumerate(self.phases):
            reqs = ", ".join(f"{r.request_id}: {len(r.prompt)} tok {r.prompt[:3]}..., "
                             f"max {r.max_tokens}, n {r.n}"
                             + (f", abort +{r.abort_after}" if r.abort_after is not None else "")
                             for r in p.adds)
            lines.append(f"phase {i}{' (reset)' if p.reset_prefix_cache else ''}: [{reqs}] then "
                         + ("drain" if p.steps is None else f"{p.steps} steps"))
        return "\n".join(lines)


def _tokens(c: Chooser, n: int) -> list[int]:
    return [c.integer(3, VOCAB - 1) for _ in range(n)]


class _Builder:
    """Builds the phases; keeps request ids unique and every request inside the pool."""

    def __init__(self, c: Chooser, w: Workload) -> None:
        self.c, self.w = c, w
        self.next_id = 0
        # The longest a request may be: it must fit max_model_len and the pool, less one block.
        # (A request that needs the whole pool is never admitted while an idle cached block
        # partially matches it: admission counts the locked copy source as unavailable, so the
        # engine spins forever. That liveness bug is reported apart; it is not what this
        # generator hunts.)
        self.max_len = min(MAX_MODEL_LEN, (w.pool_blocks - 1) * w.block_size)

    def req(self, prompt: list[int], max_tokens: int, n: int = 1,
            abort_after: int | None = None) -> Req:
        max_tokens = max(1, min(max_tokens, self.max_len - 1))
        prompt = prompt[: self.max_len - max_tokens] or prompt[:1]
        rid = f"r{self.next_id}"
        self.next_id += 1
        return Req(rid, prompt, max_tokens, n, abort_after)

    def race(self, doc: list[int]) -> list[Phase]:
        """The trap for a load/copy ordering bug: compute `doc` (A), push it out of the pool into
        the tiers with a filler, then in ONE step admit B = A's prefix + new tokens (its whole
        chunks load from a tier, and its loaded blocks enter the prefix index at admission) and
        C = A cut inside a block of B's last loaded chunk (so C's match ends mid-block on a
        block whose load has not landed yet: C copies that block copy-on-write). Copies applied
        before loads give C stale KV; with tiers off, C computes it."""
        c, w = self.c, self.w
        bs, cs = w.block_size, w.chunk_size
        a = self.req(doc, c.integer(1, 3))
        filler = self.req(_tokens(c, self.max_len), c.integer(1, 3))  # fills the whole pool
        # B's whole chunks of A: at least one; its uncomputed tail must fit the step's budget
        # next to C's, or C would be admitted a step later, after the loads landed.
        chunks = max(1, min((len(a.prompt) - 1) // cs, c.integer(1, 4)))
        b_prompt = a.prompt[: chunks * cs + c.integer(0, bs - 1)] + _tokens(c, c.integer(1, 4))
        b = self.req(b_prompt, c.integer(1, 4), n=c.pick([1, 1, 2]))
        # C ends r tokens into block k of B's last loaded chunk (its last token is never
        # matched, hence the + 1).
        k = (chunks - 1) * (cs // bs) + c.integer(0, cs // bs - 1)
        r = c.integer(1, bs - 1)
        cut = k * bs + r + 1
        c_req = self.req(a.prompt[:cut], c.integer(1, 4), n=c.pick([1, 1, 2]))
        adds = [b, c_req]
        if c.coin(0.3):  # another partial hit at a different offset
            adds.append(self.req(a.prompt[: k * bs + c.integer(1, bs - 1) + 1], c.integer(1, 3)))
        return [Phase([a]), Phase([filler]), Phase(adds, steps=None if c.coin(0.5) else
                                                   c.integer(1, 3))]

    def mix(self, docs: list[list[int]]) -> Phase:
        """Ordinary shared-prefix traffic: prefixes of the documents cut anywhere (partial-block
        hits), new suffixes, n > 1, aborts; often added while others still run."""
        c = self.c
        adds = []
        for _ in range(c.integer(1, 5)):
            if c.coin(0.85):
                doc = c.pick(docs)
                prompt = doc[: c.integer(1, len(doc))] + _tokens(c, c.pick([0, 0, 1, 3, 9]))
            else:
                prompt = _tokens(c, c.integer(1, self.max_len // 2))
            abort = c.integer(0, 4) if c.coin(0.15) else None
            adds.append(self.req(prompt, c.integer(1, 8), n=c.pick([1, 1, 1, 2, 3]),
                                 abort_after=abort))
        return Phase(adds, steps=None if c.coin(0.4) else c.integer(1, 4),
                     reset_prefix_cache=c.coin(0.08))


def make_workload(c: Chooser) -> Workload:
    """A random workload: small blocks and chunks, a small pool (eviction into the tiers,
    preemption), a small step budget (chunked prefill), and at least one load/copy race."""
    bs = c.pick([2, 4, 4])
    w = Workload(block_size=bs, chunk_size=bs * c.pick([2, 4]),
                 pool_blocks=c.integer(64 // bs, 128 // bs),
                 max_num_batched_tokens=c.pick([16, 24, 32, 64]),
                 max_num_seqs=c.pick([4, 8, 16]),
                 write_policy=c.pick(["write_back", "write_back", "write_through"]))
    b = _Builder(c, w)
    docs = [_tokens(c, c.integer(2 * w.chunk_size + 2, min(b.max_len - 8, 72)))
            for _ in range(c.integer(1, 3))]
    for _ in range(c.integer(1, 3)):
        if c.coin(0.5):
            w.phases.append(b.mix(docs))
        w.phases.extend(b.race(c.pick(docs)))
    return w


# -- running ---------------------------------------------------------------------------------
@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, float]]


@dataclass
class RunResult:
    outputs: dict[str, list[Completion]]  # by request id, compared ones only
    stats: "EngineStats | None"


@dataclass
class Tiers:
    """The storage tiers of one run: host memory always, plus a temp dir and/or Redis."""

    combo: str
    redis_url: str | None = None
    disk_dir: str | None = None

    def config(self, w: Workload) -> dict:
        cfg: dict[str, Any] = {"chunk_size": w.chunk_size, "local_cpu": True,
                               "max_local_cpu_size": 0.05, "write_policy": w.write_policy}
        if "disk" in self.combo:
            self.disk_dir = tempfile.mkdtemp(prefix="kvserve-diff-disk-")
            cfg.update(local_disk=self.disk_dir, max_local_disk_size=0.05)
        if "redis" in self.combo:
            assert self.redis_url is not None, "a Redis combo needs a server"
            cfg.update(remote_url=self.redis_url)
        return cfg

    def cleanup(self) -> None:
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)


def kv_bytes_per_token(model_dir: Path) -> int:
    """float32 K and V of every layer, for a checkpoint directory's config.json or a GGUF
    file's metadata (read by transformers' own rules for the former)."""
    import json

    if Path(model_dir).is_file():  # a GGUF file: kvserve's reader of its metadata
        from kvserve.model_loader.loader import read_config

        cfg = read_config(model_dir)[0]
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def make_llm(model_dir: Path, w: Workload, prefix_caching: bool = True,
             tiers: Tiers | None = None, preemption_mode: str = "auto", tp: int = 1,
             speculative_config: dict | None = None, **engine: Any) -> LLM:
    """`tp` > 1: tensor parallelism, each rank's pool of the same `pool_blocks` (its share of
    the KV heads: the budget is per rank); `engine`: more engine arguments (e.g.
    deterministic, or max_num_batched_tokens / max_num_seqs in place of the workload's)."""
    engine.setdefault("max_num_batched_tokens", w.max_num_batched_tokens)
    engine.setdefault("max_num_seqs", w.max_num_seqs)
    return LLM(model=str(model_dir), dtype="float32", block_size=w.block_size,
               max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=w.pool_blocks * w.block_size * kv_bytes_per_token(model_dir)
               // tp,
               enable_prefix_caching=prefix_caching,
               kv_tier_config=tiers.config(w) if tiers is not None else None, seed=0,
               preemption_mode=preemption_mode, tensor_parallel_size=tp,
               speculative_config=speculative_config, **engine)


def run(llm: LLM, w: Workload, max_steps: int = 20_000,
        namespace: Callable[[str], str | None] | None = None) -> RunResult:
    """Play the workload through the public engine API; check the engine's invariants after
    every step and that no KV block is held once every request has finished or been aborted.
    `namespace`: a request id's cache_salt (as the server gives one per tenant), else none."""
    engine = llm.engine
    outputs: dict[str, list[Completion]] = {}
    aborted: set[str] = set()
    pending_aborts: dict[str, int] = {}  # request id -> steps left
    steps = 0

    def one_step() -> None:
        nonlocal steps
        for rid in [r for r, left in pending_aborts.items() if left <= 0]:
            engine.abort_request(rid)
            del pending_aborts[rid]
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                outputs[out.request_id] = [Completion(list(o.token_ids), list(o.logprobs or []))
                                           for o in sorted(out.outputs, key=lambda o: o.index)]
        engine.check_invariants()
        for rid in pending_aborts:
            pending_aborts[rid] -= 1
        steps += 1
        assert steps < max_steps, "the engine did not finish"

    for phase in w.phases:
        if phase.reset_prefix_cache:
            llm.reset_prefix_cache()
        for r in phase.adds:
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, n=r.n,
                                    ignore_eos=True, logprobs=2)
            engine.add_request({"prompt_token_ids": r.prompt}, params, request_id=r.request_id,
                               cache_salt=namespace(r.request_id) if namespace else None)
            if r.abort_after is not None:
                aborted.add(r.request_id)
                pending_aborts[r.request_id] = r.abort_after
        if phase.steps is None:
            while engine.has_unfinished_requests():
                one_step()
        else:
            for _ in range(phase.steps):
                one_step()
    while engine.has_unfinished_requests() or pending_aborts:
        one_step()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0, f"KV blocks leaked: usage {stats.kv_cache_usage}"
    return RunResult(outputs, stats)


# -- comparing -------------------------------------------------------------------------------
def compare(want: RunResult, got: RunResult, tol: float = LOGPROB_TOL) -> list[str]:
    """Differences between two runs of one workload (empty if none).

    Tokens must be equal and every reported logprob within `tol`. The one allowed divergence
    is a true greedy tie: where the reference's top-2 logprobs are within `tol`, float noise of
    another batching may pick the other one, and the two continuations are not comparable
    after that point."""
    diffs = []
    assert want.outputs.keys() == got.outputs.keys(), "the runs finished different requests"
    for rid in sorted(want.outputs):
        for i, (a, b) in enumerate(zip(want.outputs[rid], got.outputs[rid])):
            where = f"{rid}#{i}"
            if len(a.token_ids) != len(b.token_ids):
                diffs.append(f"{where}: {len(a.token_ids)} vs {len(b.token_ids)} tokens")
                continue
            for t, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
                la, lb = a.logprobs[t], b.logprobs[t]
                if ta != tb:
                    gap = abs(la.get(ta, -math.inf) - la.get(tb, math.inf))
                    if gap > tol:  # inf: the other token is not even in the reference's top-2
                        diffs.append(f"{where} token {t}: {ta} vs {tb} (reference top-2 gap "
                                     f"{gap:.4g})")
                    break  # a tie (or a reported difference): the rest is not comparable
                for tok in la.keys() | lb.keys():
                    if tok in la and tok in lb and abs(la[tok] - lb[tok]) > tol:
                        diffs.append(f"{where} token {t}: logprob of {tok} {la[tok]:.6f} vs "
                                     f"{lb[tok]:.6f}")
                        break
                else:
                    continue
                break
    return diffs
