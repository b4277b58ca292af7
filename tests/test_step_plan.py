"""The step plan's order, executed by the worker (worker/model_runner.py): saves read blocks before a load overwrites
them, and copies read a block after the load that fills it (issue 11's defect 1 was a copy that
ran before the load of its source)."""

from __future__ import annotations

import pytest
import torch

from helpers import pool_over

from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.step_sampler import StepSampler
from kvserve.worker.step import StepFailed, StepInput
from kvserve.kv.plan import ChunkLoad, ChunkSave, StepPlan
from kvserve.attention.torch_backend import TorchAttentionBackend


def _runner(num_blocks: int = 6, block_size: int = 2):
    caches = [(torch.zeros(num_blocks, block_size, 1, 4), torch.zeros(num_blocks, block_size, 1, 4))
              for _ in range(2)]
    pool = pool_over(caches)
    for b in range(num_blocks):  # block b holds the value b everywhere
        for k, v in caches:
            k[b] = b
            v[b] = b
    runner = ModelRunner.__new__(ModelRunner)
    runner.tensors = pool
    runner.backend = TorchAttentionBackend(pool, 1.0)
    runner.sampling = StepSampler()
    return runner, caches


def test_saves_then_loads_then_copies():
    runner, caches = _runner()
    loaded = torch.full((2, 2, 2, 1, 4), 9.0)  # one block's worth of KV: [layers, k/v, tokens, h, d]
    plan = StepPlan(saves=[ChunkSave(7, (3,))],  # block 3 is evicted and reused below
                    loads=[ChunkLoad((3,), loaded)],  # a tier chunk lands in block 3
                    copies=[(3, 5)])  # a partial hit on the loaded block copies it into block 5
    saved = dict(runner.apply_plan(plan))
    assert torch.all(saved[7] == 3), "the save read the block after it was reused"
    for k, v in caches:
        assert torch.all(k[3] == 9) and torch.all(v[3] == 9), "the load did not land"
        assert torch.all(k[5] == 9) and torch.all(v[5] == 9), "the copy read its source too early"
        assert torch.all(k[4] == 4), "a block outside the plan changed"


def test_an_empty_plan_touches_nothing():
    runner, caches = _runner()
    before = [t.clone() for pair in caches for t in pair]
    assert runner.apply_plan(StepPlan()) == []
    assert all(torch.equal(a, b) for a, b in zip(before, [t for p in caches for t in p]))
    assert not StepPlan()


def test_a_failed_load_hands_back_the_saves_read_before_it():
    """The worker reads the saves first; a load that then fails raises StepFailed("load")
    carrying them, so the scheduler's side still stores them (and drops its prefix cache)."""
    runner, caches = _runner()
    plan = StepPlan(saves=[ChunkSave(7, (3,))],
                    loads=[ChunkLoad((3,), torch.zeros(1, 2, 2, 1, 4))])  # wrong layer count
    with pytest.raises(StepFailed) as failed:
        runner.execute(StepInput(plan=plan))
    assert failed.value.stage == "load" and failed.value.__cause__ is not None
    assert [h for h, _ in failed.value.saved] == [7]
    assert torch.all(failed.value.saved[0][1] == 3)
