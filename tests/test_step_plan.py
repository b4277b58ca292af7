"""The step plan's order, executed by the runner: saves read blocks before a load overwrites
them, and copies read a block after the load that fills it (issue 11's defect 1 was a copy that
ran before the load of its source)."""

from __future__ import annotations

import torch

from helpers import pool_over

from kvserve.engine.model_runner import ModelRunner
from kvserve.kv.plan import ChunkLoad, ChunkSave, StepPlan
from kvserve.model.attention.torch_backend import TorchAttentionBackend


class _RecordingTiers:
    def __init__(self) -> None:
        self.saved: dict[int, torch.Tensor] = {}

    def save(self, chunk_hash: int, data: torch.Tensor) -> None:
        self.saved[chunk_hash] = data.clone()


class _KV:
    def __init__(self) -> None:
        self.tiers = _RecordingTiers()


def _runner(num_blocks: int = 6, block_size: int = 2):
    caches = [(torch.zeros(num_blocks, block_size, 1, 4), torch.zeros(num_blocks, block_size, 1, 4))
              for _ in range(2)]
    pool = pool_over(caches)
    for b in range(num_blocks):  # block b holds the value b everywhere
        for k, v in caches:
            k[b] = b
            v[b] = b
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv, runner.tensors = _KV(), pool
    runner.backend = TorchAttentionBackend(pool, 1.0)
    return runner, caches


def test_saves_then_loads_then_copies():
    runner, caches = _runner()
    loaded = torch.full((2, 2, 2, 1, 4), 9.0)  # one block's worth of KV: [layers, k/v, tokens, h, d]
    plan = StepPlan(saves=[ChunkSave(7, (3,))],  # block 3 is evicted and reused below
                    loads=[ChunkLoad((3,), loaded)],  # a tier chunk lands in block 3
                    copies=[(3, 5)])  # a partial hit on the loaded block copies it into block 5
    runner.apply_plan(plan)
    assert torch.all(runner.kv.tiers.saved[7] == 3), "the save read the block after it was reused"
    for k, v in caches:
        assert torch.all(k[3] == 9) and torch.all(v[3] == 9), "the load did not land"
        assert torch.all(k[5] == 9) and torch.all(v[5] == 9), "the copy read its source too early"
        assert torch.all(k[4] == 4), "a block outside the plan changed"


def test_an_empty_plan_touches_nothing():
    runner, caches = _runner()
    before = [t.clone() for pair in caches for t in pair]
    runner.apply_plan(StepPlan())
    assert all(torch.equal(a, b) for a, b in zip(before, [t for p in caches for t in p]))
    assert not StepPlan()
