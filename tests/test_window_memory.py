"""Memory that follows the window (issue 15 part 3, Mistral-style: every layer windowed).

Through the engine, against transformers on the same weights:

* every block on the pool's free list is filled with NaN before each step, so a backend that
  read a released block (or any block the request does not hold) would return NaN: greedy
  tokens must still equal transformers' (a released block is never read);
* a request holds, at its last step, the blocks of its window plus at most one, which is what
  the planner's spec computes (`KVCacheSpec.bytes_per_request`), against every block with
  `disable_hybrid_kv_cache_manager`;
* a pool small enough that idle blocks of a shared document are evicted while later requests
  still hit it (hits over hollow index nodes, vLLM's window rule) keeps parity;
* a hybrid model (some full layers) with `disable_hybrid_kv_cache_manager` keeps every block in
  one table (per-group tables: tests/test_hybrid_memory.py).
"""

from __future__ import annotations

import random

import pytest
from helpers import (
    generate_checked,
    hf_greedy,
    save_random_checkpoint,
)
from window_models import _COMMON, GREEDY, NEW_TOKENS, VOCAB, WINDOW
from window_models import prompts as _prompts
from window_models import watch_tables as _watch
from window_models import window_llm as _llm

from kvserve import LLM
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.planner.memory import make_plan
from kvserve.planner.model import ModelSpec

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    cfg = transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                     tie_word_embeddings=False, rope_theta=1e4)
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("mistral") / "m", seed=3)


@pytest.fixture(scope="module")
def qwen2_hybrid(tmp_path_factory):
    cfg = transformers.Qwen2Config(
        **_COMMON, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("qwen2") / "q", seed=4)


@pytest.mark.parametrize("block_size", [8, 7])
def test_released_blocks_are_never_read(mistral, block_size):
    """Prefix caching off: a released block goes straight to the free list, then gets NaN."""
    prompts = _prompts([20, 33, 100, 250])
    expected = hf_greedy(mistral, prompts, NEW_TOKENS)
    llm = _llm(mistral, block_size=block_size, enable_prefix_caching=False,
               max_num_batched_tokens=64)
    assert llm.engine.kv.window == WINDOW
    tables = _watch(llm, poison=True)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    longest = tables[outs[-1].request_id][0]
    assert NULL_BLOCK in longest, "nothing was released"


def test_held_blocks_equal_the_planner(mistral):
    """At its last step a 250 + 8 token request holds its window's blocks plus at most one: what
    the spec (the planner's) computes, not the 33 blocks of the whole sequence."""
    bs = 8
    total = 250 + NEW_TOKENS
    figures = {}
    for keep_all in (False, True):
        llm = _llm(mistral, block_size=bs, disable_hybrid_kv_cache_manager=keep_all)
        tables = _watch(llm, poison=False)
        out = generate_checked(llm, [{"prompt_token_ids": _prompts([250])[0]}], GREEDY)[0]
        # The last step computed token total - 1 (the last sampled one is never fed back).
        figures[keep_all] = sum(b != NULL_BLOCK for b in tables[out.request_id][0])
        spec = llm.engine.kv_spec
    planned = spec.bytes_per_request(total) // spec.bytes_per_block
    assert planned == -(-WINDOW // bs)
    assert planned <= figures[False] <= planned + 1, figures
    assert figures[True] == -(-(total - 1) // bs)


def test_prefix_hits_over_evicted_history(mistral):
    """A shared document, then filler that evicts its idle blocks (the pool is small), then
    requests extending the document: hits need only the blocks in the window at the hit point,
    and every output must still equal transformers'."""
    rng = random.Random(9)
    doc = [rng.randrange(3, VOCAB) for _ in range(200)]
    filler = _prompts([120, 120], seed=2)
    tails = [doc + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 30)]
    expected = hf_greedy(mistral, [doc] + filler + tails, NEW_TOKENS)
    llm = _llm(mistral, block_size=8, num_blocks=40)
    got = []
    for batch in ([doc], filler, tails):
        got += generate_checked(llm, [{"prompt_token_ids": p} for p in batch], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert llm.engine.kv.index.num_evicted_blocks > 0, "the pool forced no eviction"
    assert all(o.num_cached_tokens >= 192 for o in got[-2:]), [o.num_cached_tokens for o in got]


def test_hybrid_disabled_keeps_every_block(qwen2_hybrid):
    """Some layers attend to everything: with per-group tables off, one table cannot release
    anything, and the capacity figures count every block."""
    llm = _llm(qwen2_hybrid, block_size=8, disable_hybrid_kv_cache_manager=True)
    assert llm.engine.kv.window is None and llm.engine.kv.num_groups == 1
    tables = _watch(llm, poison=False)
    prompt = _prompts([100])[0]
    out = generate_checked(llm, [{"prompt_token_ids": prompt}], GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(qwen2_hybrid, [prompt], NEW_TOKENS)[0]
    assert NULL_BLOCK not in tables[out.request_id][0]


def test_tiers_keep_every_block(mistral, tmp_path):
    """Storage tiers save whole chunks, so with them the engine keeps every block (and says so)."""
    llm = _llm(mistral, block_size=8,
               kv_tier_config={"chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.01})
    assert llm.engine.kv.window is None


def _concurrency(llm: LLM, path) -> tuple[float, float]:
    """(the engine's start-up figure, `kvserve plan`'s for the same pool and context)."""
    kv, cfg = llm.engine.kv, llm.engine.config
    plan = make_plan(ModelSpec.load(str(path)), kv_dtype="fp32", context_len=cfg.max_model_len,
                     block_size=cfg.block_size, num_gpu_blocks=kv.num_blocks)
    return kv.num_blocks / kv.final_blocks(cfg.max_model_len), plan["capacity"]["max_concurrency"]


def test_startup_line_agrees_with_the_planner(mistral, qwen2_hybrid, monkeypatch):
    """Mistral-style: the engine's figure is the planner's (the window is whole blocks here);
    a hybrid with per-group tables off stays at full length, below the planner's (per-group
    tables: tests/test_hybrid_memory.py)."""
    from kvserve.engine import llm_engine

    lines: list[str] = []
    monkeypatch.setattr(llm_engine.logger, "info", lambda msg, *a: lines.append(msg % a))
    llm = _llm(mistral, block_size=8, num_blocks=100)
    engine_x, plan_x = _concurrency(llm, mistral)
    assert engine_x == pytest.approx(plan_x) == pytest.approx(100 / (WINDOW // 8))
    assert any(f"per request: {plan_x:.2f}x" in line for line in lines), lines  # start-up line
    keep = _llm(mistral, block_size=8, num_blocks=100, disable_hybrid_kv_cache_manager=True)
    assert _concurrency(keep, mistral)[0] == pytest.approx(100 / (512 // 8))
    hybrid_x, hybrid_plan_x = _concurrency(_llm(qwen2_hybrid, block_size=8, num_blocks=100,
                                                disable_hybrid_kv_cache_manager=True),
                                           qwen2_hybrid)
    assert hybrid_x == pytest.approx(100 / (512 // 8))
    assert hybrid_x < hybrid_plan_x
