"""Hit audits (`--kv-audit-rate R`, kvserve/engine/audit.py).

1. The acceptance test: one cached block's KV is overwritten with garbage; hits on its prefix,
   one at a time, are audited with probability R = 0.05; the audit catches it within 3/R hits
   (not on the first: the sampling is real), drops it and the blocks below it, logs its hash,
   and no later request is served it: the next one recomputes from that block on and its greedy
   tokens equal a run with prefix caching off (an independent reference, not the cache).
2. Without corruption, every hit audited (R = 1) gives no mismatch: whole prompts and chunked
   prefill, unquantized and quantized KV, a pool tight enough to preempt; the outputs and the
   hit statistics are those of an engine without audits and nothing leaks. An audit computed
   over several steps gives way to a waiting request; one the pool must preempt is given up.
3. R = 0 (the default) builds no Auditor and runs no audit request; bad rates are refused.

The model is conftest's Llama checkpoint: its greedy continuation depends on the whole context,
so a corrupted block shows in the tokens (the make-model tiny one mostly repeats the prompt).
"""

from __future__ import annotations

import logging
import random
from math import inf

import pytest
import torch
from conftest import make_hf_checkpoint
from helpers import kv_bytes_per_token

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.audit import AUDIT_ID_PREFIX, AuditRequest
from kvserve.request import Request

BS = 16
PREFIX_BLOCKS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
VOCAB = 512  # the conftest checkpoints'


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("audit") / "llama")


def make_llm(model, pool_blocks: int = 96, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    return LLM(model=str(model), max_model_len=256, block_size=BS,
               kv_cache_memory_bytes=pool_blocks * BS * kv_bytes_per_token(model), **kwargs)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def generate(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs


def cached_nodes(llm: LLM, tokens: list[int]):
    """The prefix index's nodes for the full blocks of `tokens` (read-only)."""
    probe = Request("probe", tokens + [0], SamplingParams(max_tokens=1), 1)
    return llm.engine.kv.device_match(probe).nodes


def record_matches(llm: LLM) -> list[tuple[str, list]]:
    """Every admission from now on, as (request id, the matched nodes)."""
    kv = llm.engine.kv
    admitted: list[tuple[str, list]] = []
    admit = kv.admit

    def spy(seq, match, *args, **kwargs):
        admitted.append((seq.request_id, list(match.nodes)))
        return admit(seq, match, *args, **kwargs)

    kv.admit = spy
    return admitted


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- 1. a corrupted block is caught, dropped and never served again -------------------------------
def test_a_corrupted_block_is_caught_within_3_over_r_hits_and_never_served_again(llama):
    rate = 0.05
    llm = make_llm(llama, kv_audit_rate=rate)
    reference = make_llm(llama, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(1)
    prefix = toks(rng, PREFIX_BLOCKS * BS)
    prompts = [prefix + toks(rng, 9) for _ in range(int(3 / rate) + 3)]
    generate(llm, prompts[:1])  # caches the prefix (a miss: nothing to audit)
    nodes = cached_nodes(llm, prefix)
    assert len(nodes) == PREFIX_BLOCKS
    bad = nodes[1]
    tensors = engine.runner.tensors  # the worker's KV pool
    kv = tensors.read_blocks([bad.block])
    garbage = torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)) \
        * 10 * kv.abs().max()
    tensors.write_blocks([bad.block], garbage)

    log = Records()
    logging.getLogger("kvserve").addHandler(log)
    try:
        caught = None
        for k, prompt in enumerate(prompts[1:int(3 / rate) + 1], 1):
            [out] = generate(llm, [prompt])
            assert out.num_cached_tokens == PREFIX_BLOCKS * BS  # served the corrupted block
            if k == 1:  # and it matters: the tokens are not those of an uncached run
                assert out.outputs[0].token_ids != \
                    generate(reference, [prompt])[0].outputs[0].token_ids
            if engine.audit.stats()["mismatches"]:
                caught = k
                break
    finally:
        logging.getLogger("kvserve").removeHandler(log)
    assert caught is not None, f"not caught in {int(3 / rate)} hits at R = {rate}"
    assert caught > 1, "caught on the first hit: the sampling is not at rate R"
    # the audit compared the whole hit; only the corrupted block differed, and it went with the
    # blocks below it (computed on top of it, as far as the cache knows)
    assert engine.audit.stats() == {"audited_hits": 1, "audited_blocks": PREFIX_BLOCKS,
                                    "mismatches": 1, "dropped_blocks": PREFIX_BLOCKS - 1,
                                    "skipped": 0}
    assert not nodes[0].dropped and all(n.dropped for n in nodes[1:])
    assert engine.kv.index._node_of_block.get(bad.block) is not bad
    assert len(log.messages) == 1 and f"{bad.block_hash:x}" in log.messages[0]

    admitted = record_matches(llm)
    after = prompts[caught + 1:caught + 3]
    outs = generate(llm, after[:1]) + generate(llm, after[1:])
    # the next request recomputes from the dropped block on (and publishes fresh blocks), the
    # one after hits the fresh blocks; both give the uncached run's tokens
    assert [o.num_cached_tokens for o in outs] == [BS, PREFIX_BLOCKS * BS]
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in generate(reference, after)]
    assert all(n not in served for _, served in admitted for n in nodes[1:])
    assert cached_nodes(llm, prefix)[1] is not bad


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_corrupted_quantized_bytes_are_caught(llama, kv_cache_dtype):
    """Random bytes in a quantized block (its scales too: they may decode to inf or NaN)."""
    llm = make_llm(llama, kv_audit_rate=1.0, kv_cache_dtype=kv_cache_dtype)
    rng = random.Random(2)
    prefix = toks(rng, PREFIX_BLOCKS * BS)
    generate(llm, [prefix + toks(rng, 5)])
    bad = cached_nodes(llm, prefix)[2]
    tensors = llm.engine.runner.tensors
    shape = tensors.read_blocks([bad.block]).shape
    tensors.write_blocks([bad.block], torch.randint(
        0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    good = cached_nodes(llm, prefix)[0]
    pairs = [(good.block, good.block), (good.block, bad.block), (bad.block, bad.block)]
    diffs = tensors.block_differences(pairs, chunk=2)  # (the worker's measurement)
    assert diffs == tensors.block_differences(pairs)
    assert diffs[0] == (0.0, 0.0) and min(diffs[1]) > 1 and diffs[2] == (inf, inf)
    generate(llm, [prefix + toks(rng, 5)])
    stats = llm.engine.audit.stats()
    assert stats["mismatches"] == 1 and stats["dropped_blocks"] == PREFIX_BLOCKS - 2
    assert bad.dropped and len(cached_nodes(llm, prefix)) == 2


# -- 2. no false positives ---------------------------------------------------------------------
def workload(seed: int = 3) -> list[list[list[int]]]:
    """Rounds of prompts over two shared prefixes (one of them as long as two chunks)."""
    rng = random.Random(seed)
    prefixes = [toks(rng, 3 * BS), toks(rng, 5 * BS + 3)]
    return [[prefixes[(r + i) % 2] + toks(rng, rng.randrange(1, 20)) for i in range(3)]
            for r in range(5)]


def run_rounds(llm: LLM, rounds, params=GREEDY):
    out = [[o.outputs[0].token_ids for o in generate(llm, prompts, params)] for prompts in rounds]
    engine = llm.engine
    while engine.has_unfinished_requests():  # an audit may still be computing its prefix
        assert not engine.step()  # and returns no output
    kv = engine.kv
    assert not kv.block_tables and kv.num_available_blocks == kv.num_blocks, "KV blocks leaked"
    return out


@pytest.mark.parametrize("kv_cache_dtype,chunk", [("auto", None), ("auto", 32), ("int8", 32),
                                                  ("int4", 32), ("fp8", None)])
def test_no_mismatch_without_corruption(llama, kv_cache_dtype, chunk):
    rounds = workload()
    kwargs = dict(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=chunk)
    plain = make_llm(llama, **kwargs)
    audited = make_llm(llama, kv_audit_rate=1.0, **kwargs)
    admitted = record_matches(audited)
    assert run_rounds(audited, rounds) == run_rounds(plain, rounds)
    stats = audited.engine.audit.stats()
    assert stats["mismatches"] == 0 and stats["dropped_blocks"] == 0
    assert stats["audited_hits"] >= 4 and stats["audited_blocks"] >= 4 * 3
    audits = [rid for rid, _ in admitted if rid.startswith(AUDIT_ID_PREFIX)]
    assert len(audits) >= stats["audited_hits"]
    # audits are no queries, read nothing, publish nothing: the users' hit counts are unchanged
    a, p = audited.engine.stats(), plain.engine.stats()
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == \
        (p.prefix_cache_queries, p.prefix_cache_hits)
    assert all(not served for rid, served in admitted if rid.startswith(AUDIT_ID_PREFIX))
    assert audited.engine.kv.index.num_cached_blocks == plain.engine.kv.index.num_cached_blocks
    with pytest.raises(ValueError, match="engine's own"):
        audited.engine.add_request({"prompt_token_ids": [5, 6]}, GREEDY,
                                   request_id=AUDIT_ID_PREFIX + "0")


def test_a_tight_pool_that_preempts(llama):
    """A tight pool (preemptions): audits take only room to spare, one the pool must preempt
    is given up (never requeued ahead of user requests), and the tokens are those of an
    engine without audits."""
    rounds = workload(4)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = make_llm(llama, pool_blocks=16, max_num_batched_tokens=32)
    audited = make_llm(llama, pool_blocks=16, max_num_batched_tokens=32, kv_audit_rate=1.0)
    scheduler = audited.engine.scheduler
    preempt = scheduler._preempt

    def spy(request):
        preempt(request)
        assert not any(isinstance(r, AuditRequest) for r in scheduler.waiting)

    scheduler._preempt = spy
    assert run_rounds(audited, rounds, params) == run_rounds(plain, rounds, params)
    assert audited.engine.audit.stats()["mismatches"] == 0
    assert plain.engine.stats().num_preemptions > 0, audited.engine.audit.stats()


def _chunked_audit(llama, seed: int):
    """An engine whose step budget is one block, with an audit started on a 3-block hit: the
    hit computes its 5 new tokens, the audit the other 11 of the step (then 2 more steps)."""
    llm = make_llm(llama, kv_audit_rate=1.0, max_num_batched_tokens=BS)
    engine = llm.engine
    rng = random.Random(seed)
    prefix = toks(rng, 3 * BS)
    generate(llm, [prefix + toks(rng, 3)])
    engine.add_request({"prompt_token_ids": prefix + toks(rng, 5)}, GREEDY)
    engine.step()
    [audit] = [r for r in engine.scheduler.running if isinstance(r, AuditRequest)]
    return engine, rng, audit


def test_a_preempted_audit_is_given_up(llama):
    """An audit running over several steps (chunked) that the pool must preempt is finished,
    not requeued: its blocks are freed and it counts as skipped."""
    engine, rng, audit = _chunked_audit(llama, 5)
    assert audit.num_computed_tokens == BS - 5 and audit.request_id.startswith(AUDIT_ID_PREFIX)
    engine.scheduler._preempt(audit)
    assert audit.finished and audit.request_id not in engine.kv.block_tables
    assert audit not in engine.scheduler.waiting and audit not in engine.scheduler.running
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.audit.stats() == {"audited_hits": 0, "audited_blocks": 0, "mismatches": 0,
                                    "dropped_blocks": 0, "skipped": 1}
    assert engine.kv.num_available_blocks == engine.kv.num_blocks
    assert engine.stats().num_preemptions == 0  # an audit given up is no user's preemption


def test_a_chunked_audit_gives_way_to_waiting_requests(llama):
    """An audit computing its prefix over several steps is given up as soon as a request
    waits (which gets the step's budget), and tried once more when nothing waits."""
    engine, rng, audit = _chunked_audit(llama, 6)
    [newcomer] = engine._groups[engine.add_request({"prompt_token_ids": toks(rng, 40)}, GREEDY)]
    engine.step()
    assert audit.finished and audit.request_id not in engine.kv.block_tables
    assert newcomer.num_computed_tokens == BS - 1  # all the budget but the hit's decode
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.audit.stats() == {"audited_hits": 1, "audited_blocks": 3, "mismatches": 0,
                                    "dropped_blocks": 0, "skipped": 0}
    assert engine.kv.num_available_blocks == engine.kv.num_blocks


# -- 3. off by default; bad rates ---------------------------------------------------------------
def test_rate_zero_builds_no_auditor_and_runs_no_audit(llama):
    llm = make_llm(llama)
    assert EngineConfig().kv_audit_rate == 0.0
    assert llm.engine.audit is None and llm.engine.scheduler.audit is None
    admitted = record_matches(llm)
    run_rounds(llm, workload()[:2])
    assert admitted and not any(rid.startswith(AUDIT_ID_PREFIX) for rid, _ in admitted)
    assert any(served for _, served in admitted)  # there were hits to audit
    # the audits' id prefix is an ordinary id when they are off
    llm.engine.add_request({"prompt_token_ids": [5, 6]}, GREEDY, request_id=AUDIT_ID_PREFIX + "0")
    llm.engine.abort_request(AUDIT_ID_PREFIX + "0")


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError, match=r"kv_audit_rate must be in \[0, 1\]"):
        EngineConfig(kv_audit_rate=rate)
    with pytest.raises(ValueError, match="kv_audit_rate"):
        LLM(model="unused", kv_audit_rate=rate)
