"""Preemption by swap (kvserve/kv/swap.py): under a pool small enough to force many
preemptions, greedy outputs with preemption_mode swap, recompute and auto equal transformers'
own greedy continuations and a roomy pool's; swapped KV really went out and came back (the
counters), every fallback (space full, KV lost, recompute cheaper) still gives the right answer,
and nothing leaks (tests/helpers.py's generate_checked: invariants after every step, every
block back at the end; the scheduler's invariants include the swap space's)."""

from __future__ import annotations

import random

import pytest
import torch
from differential import kv_bytes_per_token
from helpers import generate_checked, hf_greedy

from kvserve import LLM, SamplingParams
from kvserve.kv.prefix_index import PrefixMatch
from kvserve.kv.swap import SwapSpace, SwapSpeeds

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

NEW_TOKENS = 40
BLOCK = 8
POOL_BLOCKS = 20  # 160 tokens: two of the longest requests (40 + 40) fill it


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(10, 40))]
            for _ in range(n)]


def _run(model_dir, prompts, blocks: int, mode: str, **kwargs):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              kv_cache_memory_bytes=blocks * BLOCK * kv_bytes_per_token(model_dir),
              preemption_mode=mode, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats(), llm


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return hf_checkpoints["llama"]


@pytest.fixture(scope="module")
def workload(llama):
    """48 requests, transformers' greedy continuations, and a roomy pool's."""
    prompts = _prompts(48)
    expected = hf_greedy(llama, prompts, NEW_TOKENS)
    roomy, stats, _ = _run(llama, prompts, 4000, "recompute")
    assert stats.num_preemptions == 0
    assert roomy == expected
    return prompts, expected


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_outputs_equal_a_roomy_pool_under_50_preemptions(llama, workload, mode):
    prompts, expected = workload
    got, stats, _ = _run(llama, prompts, POOL_BLOCKS, mode)
    assert stats.num_preemptions >= 50, stats.num_preemptions
    mismatches = sum(g != e for g, e in zip(got, expected))
    assert mismatches == 0
    if mode == "recompute":
        assert stats.swap == {}
    else:
        # The swaps happened (auto: copying is far faster than this prefill), and each one
        # came back: loaded, or (its blocks still cached) served from the device.
        swap = stats.swap
        assert swap["swapped_out"] >= 50, swap
        assert swap["swapped_in"] >= 0.5 * swap["swapped_out"], swap
        assert swap["swapped_in"] + swap["resumed_on_device"] == swap["swapped_out"], swap
        assert swap["bytes_in"] > 0


def test_shared_prefixes_stay_on_the_device(llama, monkeypatch):
    """Requests sharing a 32-token prefix: the blocks another request holds are not copied, and
    the resumed request hits them."""
    copied: list[tuple[int, int]] = []  # (blocks copied, blocks the request had computed)
    original = SwapSpace.swap_out

    def spy(self, kv, seq, bounded=False):
        out = original(self, kv, seq, bounded)
        if out is not None:
            copied.append((len(out.blocks), kv.blocks_for_tokens(seq.num_computed_tokens)))
        return out

    monkeypatch.setattr(SwapSpace, "swap_out", spy)
    prompts = _prompts(16, seed=1, shared=32)
    expected = hf_greedy(llama, prompts, NEW_TOKENS)
    got, stats, _ = _run(llama, prompts, POOL_BLOCKS, "swap")
    assert got == expected
    assert copied and any(n < used for n, used in copied), copied
    assert stats.swap["swapped_in"] > 0


def test_swap_counters_reach_prometheus(llama, workload):
    from kvserve.server.metrics import PrometheusStatLogger

    prompts, expected = workload
    got, stats, llm = _run(llama, prompts[:24], POOL_BLOCKS, "swap")
    assert got == expected[:24]
    metrics = PrometheusStatLogger("m")
    metrics.on_idle(llm.engine.stats())
    text = metrics.render().decode()
    swap = stats.swap
    assert swap["swapped_out"] > 0
    assert (f'kvserve:kv_swaps_total{{event="swapped_out",model_name="m"}} '
            f'{float(swap["swapped_out"])}') in text
    assert (f'kvserve:kv_swap_bytes_total{{direction="in",model_name="m"}} '
            f'{float(swap["bytes_in"])}') in text


def test_a_full_swap_space_recomputes(llama, workload):
    prompts, expected = workload
    got, stats, _ = _run(llama, prompts, POOL_BLOCKS, "swap", swap_space=3e-5)  # ~30 kB
    assert got == expected
    assert stats.swap["fallback_space_full"] > 0 and stats.swap["swapped_out"] > 0


def test_swapped_kv_that_never_came_back_recomputes(llama, workload, monkeypatch):
    """The worker's read of the swapped blocks fails (logged): the request recomputes."""
    from kvserve.worker.model_runner import ModelRunner

    prompts, expected = workload

    monkeypatch.setattr(ModelRunner, "read_swap_outs", lambda self, plan: {})
    got, stats, _ = _run(llama, prompts[:16], POOL_BLOCKS, "swap")
    assert got == expected[:16]
    assert stats.swap["fallback_lost"] > 0 and stats.swap["swapped_in"] == 0


def test_auto_recomputes_when_the_copy_is_slower(llama, workload, monkeypatch):
    """With a copy speed measured far below the prefill speed the engine observes, auto never
    swaps."""
    from kvserve.engine import swapping

    monkeypatch.setattr(swapping, "measure_copy_speed", lambda *a: 1.0)  # one byte a second
    prompts, expected = workload
    got, stats, _ = _run(llama, prompts[:16], POOL_BLOCKS, "auto")
    assert got == expected[:16]
    assert stats.num_preemptions > 0
    assert stats.swap["swapped_out"] == 0 and stats.swap["fallback_recompute_cheaper"] > 0


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_quantized_kv_swaps_exactly(llama, kv_dtype):
    """fp8 (plain codes) and int8 (codes with scales: a packed block) come back bit for bit:
    the outputs equal a roomy pool's with the same KV format."""
    prompts = _prompts(16, seed=2)
    want, _, _ = _run(llama, prompts, 4000, "recompute", kv_cache_dtype=kv_dtype)
    got, stats, _ = _run(llama, prompts, POOL_BLOCKS, "swap", kv_cache_dtype=kv_dtype)
    assert got == want
    assert stats.swap["swapped_in"] > 0


@pytest.mark.parametrize("model", ["mistral_window", "qwen2_hybrid"])
def test_windowed_and_hybrid_models_swap_with_whole_tables(decode_checkpoints, model):
    """preemption_mode='swap' keeps every block of a windowed or hybrid model in one table (as
    storage tiers do), so its requests swap; auto keeps the smaller layout and recomputes."""
    path = decode_checkpoints[model]
    prompts = _prompts(12, seed=3)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    got, stats, llm = _run(path, prompts, POOL_BLOCKS, "swap")
    assert llm.engine.kv.num_groups == 1 and llm.engine.kv.groups[0].window is None
    assert got == expected
    assert stats.num_preemptions > 0 and stats.swap["swapped_in"] > 0
    _, auto_stats, auto_llm = _run(path, prompts[:2], POOL_BLOCKS, "auto")
    assert auto_llm.engine.scheduler.swap is None and auto_stats.swap == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(preemption_mode="sometimes"), "preemption_mode must be one of"),
    (dict(swap_space=-1), "swap_space must be"),
    (dict(preemption_mode="swap", kv_cache_dtype="int4"), "cannot carry int4"),
    (dict(preemption_mode="swap", bounded_kv_policy="streaming_llm", bounded_kv_budget=64),
     "bounded KV cache"),
])
def test_bad_settings_are_refused(kwargs, message):
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kwargs)


# -- the swap space alone ----------------------------------------------------------------------
class _Seq:
    def __init__(self, rid: str, computed: int) -> None:
        self.request_id, self.num_computed_tokens = rid, computed


class _KV:
    """What swap_out reads of the manager: a table, the pool's ref counts, block arithmetic."""

    def __init__(self, table: list[int], refs: dict[int, int]) -> None:
        self.table = table
        self.pool = type("Pool", (), {"ref_counts": refs})()

    def block_table(self, seq):
        return self.table

    def blocks_for_tokens(self, n: int) -> int:
        return -(-n // 4)


def test_swap_out_skips_shared_leading_blocks_and_resume_loads_past_the_device_match():
    space = SwapSpace("swap", capacity_bytes=10_000, block_bytes=100, block_size=4)
    kv = _KV([7, 8, 9, 10], {7: 2, 8: 1, 9: 1, 10: 1})
    out = space.swap_out(kv, _Seq("r", 14))  # 14 tokens: blocks 0..3, block 0 shared
    assert out.blocks == (8, 9, 10) and space.used_bytes == 300
    space.fill({"r": torch.arange(3 * 4).view(1, 1, 12, 1, 1).float()})
    node = type("Node", (), {})()
    match = space.resume(_Seq("r", 0), PrefixMatch([node, node], block_size=4))  # 2 on device
    assert match.num_loaded_blocks == 2 and match.num_tokens == 14
    assert match.data.flatten().tolist() == list(range(4, 12))  # the device's block left out
    space.admitted("r", match)
    assert space.used_bytes == 0 and space.stats.swapped_in == 1 and len(space) == 0
    # A prefix evicted under the swapped blocks: a gap, so the request recomputes.
    space.swap_out(kv, _Seq("q", 14))
    space.fill({"q": torch.zeros(1, 1, 12, 1, 1)})
    assert space.resume(_Seq("q", 0), PrefixMatch([], block_size=4)) is None
    assert space.stats.fallbacks == {"prefix_evicted": 1} and space.used_bytes == 0


def test_swap_speeds_weigh_both_copies_against_the_observed_prefill():
    speeds = SwapSpeeds(copy_bytes_per_s=1e9)
    assert speeds.swap_is_faster(num_bytes=10**12, num_tokens=1)  # no prefill seen yet: swap
    speeds.observe_prefill(8, 1.0)  # too small a step to say anything
    assert speeds.prefill_tokens_per_s is None
    speeds.observe_prefill(1000, 1.0)
    assert speeds.swap_is_faster(num_bytes=10**6, num_tokens=10)  # 2 ms vs 10 ms
    assert not speeds.swap_is_faster(num_bytes=10**7, num_tokens=10)  # 20 ms vs 10 ms
    speeds.observe_prefill(2000, 1.0)  # a moving average of the steps
    assert speeds.prefill_tokens_per_s == pytest.approx(1200.0)


def test_an_empty_step_after_a_prefetch_wait_measures_nothing(llama, monkeypatch):
    """auto reads the prefill speed off each step's batch; a step whose wait for a tier load
    ended with still nothing to run (the load not yet usable) runs an empty batch, and that
    must be a step like any other, not an index error (seen in CI on the tier tests)."""
    llm = LLM(model=str(llama), dtype="float32", block_size=BLOCK, max_model_len=256,
              preemption_mode="auto")
    speeds = llm.engine.scheduler.swap.speeds
    observed = []
    monkeypatch.setattr(speeds, "observe_prefill", lambda *a: observed.append(a))
    monkeypatch.setattr(llm.engine.kv, "wait_for_prefetch", lambda seconds: True)
    assert llm.engine.step() == []
    assert observed == []
    prompts = _prompts(2, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama, prompts, NEW_TOKENS)
    assert observed  # the prefill steps were measured
    llm.engine.shutdown()
