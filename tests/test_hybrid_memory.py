"""Memory that follows the window for hybrid models (issue 15 part 2: some layers full, some
windowed: Gemma 3, Qwen2 `layer_types`), with per-group block tables over one pool.

Through the engine, against transformers on the same weights:

* every block on the pool's free list (in every slot tensor, so in every group) is filled with
  NaN before each step: a backend that read a released block, or another group's block, would
  return NaN, and greedy tokens must still equal transformers'. Block sizes 16 and 7, chunked
  prefill, preemption and prefix hits over evicted history; the Triton backend too (under
  Triton's interpreter without a GPU, as tests/test_sliding_window.py runs it);
* the layout: a 4 + 2 layer model makes groups of 2 layers (the gcd), full groups first;
* at its last step a request holds, per windowed group, its window's blocks plus at most one,
  every block in a full group: the planner's figure (`KVCacheSpec.bytes_per_request`) up to one
  block per group, against every block with `disable_hybrid_kv_cache_manager`;
* the start-up figure, admission and `kvserve plan` agree, and the pool holds more requests at
  once than the keep-everything build.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # Triton's interpreter, before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import (
    generate_checked,
    hf_greedy,
    save_random_checkpoint,
)
from window_models import _COMMON, GREEDY, NEW_TOKENS, VOCAB, WINDOW
from window_models import prompts as _prompts
from window_models import watch_tables as _watch
from window_models import window_llm as _llm

from kvserve import LLM, SamplingParams
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.spec import FullAttentionSpec, SlidingWindowSpec
from kvserve.planner.memory import make_plan
from kvserve.planner.model import ModelSpec

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


S, F = "sliding_attention", "full_attention"


def _configs():
    return {
        # Four local layers, two global: groups of two layers (gcd(4, 2)), three groups.
        "qwen2": transformers.Qwen2Config(**_COMMON, num_hidden_layers=6, use_sliding_window=True,
                                          sliding_window=WINDOW, layer_types=[S, S, F, S, S, F],
                                          tie_word_embeddings=True),
        # Gemma 3's own pattern shrunk: two local layers to one global, groups of one layer.
        "gemma3": transformers.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
            layer_types=[S, S, F], query_pre_attn_scalar=24, final_logit_softcapping=30.0),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {name: save_random_checkpoint(cfg, root / name, seed=i, perturb_norms=True)
            for i, (name, cfg) in enumerate(_configs().items())}


def test_layout_groups_of_equal_size(checkpoints):
    llm = _llm(checkpoints["qwen2"], block_size=8)
    groups = llm.engine.page_groups
    assert [g.layers for g in groups] == [(2, 5), (0, 1), (3, 4)]
    assert isinstance(groups[0].spec, FullAttentionSpec)
    assert all(isinstance(g.spec, SlidingWindowSpec) for g in groups[1:])
    pool = llm.engine.tensors
    assert len(pool.storage()) == 2 and pool.layer_group == [1, 1, 0, 2, 2, 0]
    assert pool.layers[0] is pool.layers[2] is pool.layers[3]  # slot 0 of every group
    assert llm.engine.kv.num_groups == 3
    keep = _llm(checkpoints["qwen2"], block_size=8, disable_hybrid_kv_cache_manager=True)
    assert keep.engine.page_groups is None and keep.engine.kv.num_groups == 1


SCENARIOS = {
    "block16": dict(block_size=16),
    "block7": dict(block_size=7),
    "chunked": dict(block_size=16, max_num_batched_tokens=40),
    # The longest request alone needs most of this pool: others get preempted.
    "preempt": dict(block_size=8, num_blocks=34),
}


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_released_blocks_are_never_read(checkpoints, name, scenario):
    preempt = scenario == "preempt"
    lengths = [5, 31, 32, 33, 49, 100, 150, 250] if preempt else [20, 33, 100, 250]
    prompts = _prompts(lengths, seed=len(name))
    path = checkpoints[name]
    new = 16 if preempt else NEW_TOKENS  # decodes that outgrow the pool
    expected = hf_greedy(path, prompts, new)
    llm = _llm(path, enable_prefix_caching=False, **SCENARIOS[scenario])
    tables = _watch(llm, poison=True)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    longest = tables[outs[-1].request_id]
    assert NULL_BLOCK not in longest[0], "a full group released a block"
    assert all(NULL_BLOCK in t for t in longest[1:]), "a windowed group released nothing"
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool forced no preemption"


@pytest.mark.parametrize("name", list(_configs()))
def test_prefix_hits_over_evicted_history(checkpoints, name):
    """A shared document, filler that evicts idle blocks (small pool; windowed entries are
    hollowed while the full group's stay), then requests extending the document: hits valid in
    every group, NaN in every free block, outputs equal transformers'."""
    path = checkpoints[name]
    rng = random.Random(9)
    doc = [rng.randrange(3, VOCAB) for _ in range(200)]
    filler = _prompts([120, 120], seed=2)
    tails = [doc + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 30)]
    expected = hf_greedy(path, [doc] + filler + tails, NEW_TOKENS)
    llm = _llm(path, block_size=8, num_blocks=48)
    _watch(llm, poison=True)
    got = []
    for batch in ([doc], filler, tails):
        got += generate_checked(llm, [{"prompt_token_ids": p} for p in batch], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == expected
    kv = llm.engine.kv
    assert sum(g.index.num_evicted_blocks for g in kv.groups) > 0, "no eviction was forced"
    assert all(o.num_cached_tokens >= 192 for o in got[-2:]), [o.num_cached_tokens for o in got]


@pytest.mark.parametrize("name", list(_configs()))
def test_held_blocks_equal_the_planner(checkpoints, name):
    """At its last step a 250 + 8 token request holds, per windowed group, its window's blocks
    plus at most one, per full group every block: the spec's (the planner's) figure up to one
    block per group."""
    bs = 8
    total = 250 + NEW_TOKENS
    held = {}
    for keep_all in (False, True):
        llm = _llm(checkpoints[name], block_size=bs, disable_hybrid_kv_cache_manager=keep_all)
        tables = _watch(llm, poison=False)
        out = generate_checked(llm, [{"prompt_token_ids": _prompts([250])[0]}], GREEDY)[0]
        held[keep_all] = [sum(b != NULL_BLOCK for b in t) for t in tables[out.request_id]]
        engine = llm.engine
    spec = engine.kv_spec
    layers = sum(len(g.layers) for g in spec.groups)
    # The planner's bytes in blocks of one group's layers (a page of the hybrid pool).
    page = spec.page_bytes(_llm(checkpoints[name], block_size=bs).engine.page_groups)
    planned = spec.bytes_per_request(total) / page
    hybrid = held[False]
    full, windowed = -(-(total - 1) // bs), -(-WINDOW // bs)
    assert hybrid[0] == full and all(windowed <= h <= windowed + 1 for h in hybrid[1:]), hybrid
    assert planned <= sum(hybrid) <= planned + len(hybrid), (planned, hybrid)
    assert held[True] == [full], held[True]  # one table of every layer
    # In bytes: what the hybrid holds against keeping every block.
    per_layer = page / (layers // len(hybrid))
    assert sum(hybrid) * page < held[True][0] * per_layer * layers


def _concurrency(llm: LLM, path) -> tuple[float, float]:
    """(the engine's start-up figure, `kvserve plan`'s for the same pool bytes and context)."""
    engine = llm.engine
    kv, cfg = engine.kv, engine.config
    pool_bytes = kv.num_blocks * engine.kv_spec.page_bytes(engine.page_groups)
    plan = make_plan(ModelSpec.load(str(path)), kv_dtype="fp32", context_len=cfg.max_model_len,
                     block_size=cfg.block_size, kv_cache_memory=pool_bytes)
    return kv.num_blocks / kv.final_blocks(cfg.max_model_len), plan["capacity"]["max_concurrency"]


@pytest.mark.parametrize("name", list(_configs()))
def test_capacity_agrees_with_the_planner(checkpoints, name, monkeypatch):
    """The start-up line, admission's count and the planner's figure agree up to one block per
    group; the hybrid holds more max-length requests than the keep-everything build."""
    from kvserve.engine import llm_engine

    lines: list[str] = []
    monkeypatch.setattr(llm_engine.logger, "info", lambda msg, *a: lines.append(msg % a))
    path = checkpoints[name]
    llm = _llm(path, block_size=8, num_blocks=100)
    engine_x, plan_x = _concurrency(llm, path)
    groups = llm.engine.kv.num_groups
    per_request = llm.engine.kv.final_blocks(512)
    assert engine_x <= plan_x <= engine_x * per_request / (per_request - groups)
    assert any(f"per request: {engine_x:.2f}x" in line for line in lines), lines
    # Admission counts a whole prompt at once in every group (prefilled in one step at worst).
    assert llm.engine.kv.peak_blocks(512, 512) == groups * (512 // 8)
    keep = _llm(path, block_size=8, num_blocks=100, disable_hybrid_kv_cache_manager=True)
    keep_x, _ = _concurrency(keep, path)
    assert keep_x == pytest.approx(100 / (512 // 8))
    assert engine_x > 1.3 * keep_x


def test_concurrency_at_a_fixed_pool(checkpoints):
    """Same pool bytes, long requests decoding together: the hybrid runs more of them at once
    (windowed groups let go of what falls out of the window) and outputs stay right."""
    path = checkpoints["qwen2"]
    prompts = _prompts([200] * 6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(path, prompts, 40)
    peak = {}
    for keep_all in (False, True):
        llm = _llm(path, block_size=8, num_blocks=90, enable_prefix_caching=False,
                   disable_hybrid_kv_cache_manager=keep_all)
        engine = llm.engine
        running: list[int] = []

        def spy(*a, _step=engine.scheduler.schedule, _scheduler=engine.scheduler,
                _running=running, **k):
            batch = _step(*a, **k)
            _running.append(len(_scheduler.running))
            return batch

        engine.scheduler.schedule = spy
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        peak[keep_all] = max(running)
    assert peak[False] > peak[True], peak


def test_triton_backend_released_blocks_are_never_read(checkpoints):
    """The Triton kernels with per-group tables: Gemma 3 (three groups), an odd block size,
    chunked prefill next to decodes, NaN in every free block, prompts past the window."""
    pytest.importorskip("triton")
    path = checkpoints["gemma3"]
    prompts = _prompts([5, 45, 90], seed=7)
    expected = hf_greedy(path, prompts, 6)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = _llm(path, block_size=5, attention_backend="triton", device=device,
               enforce_eager=True, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert llm.engine.kv.num_groups == 3
    tables = _watch(llm, poison=device == "cpu")  # the poison helper fills CPU tensors
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(NULL_BLOCK in t for t in tables[outs[-1].request_id][1:])
