"""Acceptance 2: property tests for the block pool and the block tables.

No block is owned twice, ref counts balance, and every block returns to the free list after any
random sequence of add, step and abort."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from helpers import kv_bytes_per_token

from kvserve import LLM, SamplingParams
from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / release against a plain list-of-holders model."""

    @initialize(num_blocks=st.integers(1, 40))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.holders: list[list[int]] = []

    @rule(n=st.integers(0, 12))
    def allocate(self, n):
        if n > self.pool.num_free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        held = {b for h in self.holders for b in h}
        assert not held & set(blocks), "a held block was handed out again"
        assert len(set(blocks)) == n
        self.holders.append(blocks)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share(self, data):
        source = data.draw(st.sampled_from(self.holders))
        prefix = source[: data.draw(st.integers(0, len(source)))]
        self.pool.share(prefix)
        self.holders.append(list(prefix))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.pool.release(self.holders.pop(i))

    @invariant()
    def consistent(self):
        if hasattr(self, "pool"):
            self.pool.check_invariants(self.holders)

    def teardown(self):
        if hasattr(self, "pool"):
            for h in self.holders:
                self.pool.release(h)
            assert self.pool.num_free == self.pool.num_blocks


TestBlockPool = PoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_release_of_free_block_is_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.release([0])
    with pytest.raises(ValueError):
        pool.share([1])


@pytest.fixture(scope="module")
def small_pool_llm(tiny_model_dir):
    # 24 blocks of 4 tokens: requests compete for blocks, so preemption happens.
    return LLM(model=str(tiny_model_dir), block_size=4, max_model_len=96, max_num_seqs=6,
               max_num_batched_tokens=40,
               kv_cache_memory_bytes=24 * 4 * kv_bytes_per_token(tiny_model_dir))


class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort on a real engine with a tiny pool."""

    def __init__(self, llm):
        super().__init__()
        self.llm = llm
        self.engine = llm.engine
        self.engine.reset_prefix_cache()  # each example starts from an empty cache
        self.live: list[str] = []

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 30),
          temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
    def add(self, prompt_len, max_tokens, temperature, seed):
        vocab = self.engine.model_config.vocab_size
        prompt = [(seed * 7 + i * 13) % (vocab - 3) + 3 for i in range(prompt_len)]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                ignore_eos=True)
        self.live.append(self.engine.add_request({"prompt_token_ids": prompt}, params))

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished:
                self.live.remove(out.request_id)
                assert len(out.outputs[0].token_ids) >= 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live))
        self.engine.abort_request(rid)
        self.live.remove(rid)

    @invariant()
    def consistent(self):
        self.engine.check_invariants()

    def teardown(self):
        for rid in list(self.live):
            self.engine.abort_request(rid)
        assert not self.engine.has_unfinished_requests()
        assert self.engine.kv.num_available_blocks == self.engine.kv.num_blocks, "KV blocks leaked"


def test_engine_add_step_abort(small_pool_llm):
    run_state_machine_as_test(
        lambda: EngineMachine(small_pool_llm),
        settings=settings(max_examples=40, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck)))
