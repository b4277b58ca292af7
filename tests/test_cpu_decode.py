"""The one-call CPU decode (kvserve/layers/fast_decode.py): decode steps of up to four sequences
run every layer in one C++ call. Checked against transformers' greedy continuations (1 to 4
running sequences, blocks of 16 and 7, a sliding window, a hybrid model's per-group tables),
bit for bit against the layer-by-layer path it replaces, and for the steps and caches it must
leave to that path."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_checkpoint
from helpers import greedy_ids, hf_greedy, random_prompts, record_decode_steps

from kvserve import LLM
from kvserve.kernels.cpu import gemv
from kvserve.attention import cpu_paged

pytestmark = pytest.mark.skipif(gemv.load() is None or cpu_paged.load_kernel() is None,
                                reason="the C++ kernels could not be built")

MAX_TOKENS = (5, 9, 13, 17)  # one per prompt: steps with 4, 3, 2, then 1 running sequence
def _engine(path, monkeypatch, fast: bool = True, **kwargs) -> tuple[LLM, dict]:
    """An engine whose every projection runs the GEMV at <= 4 rows (the plan the one-call path
    needs; `auto` picks MKL on these tiny shapes), recording the rows of each step the path
    ran, the steps it left, and every logits tensor; `fast=False`: the path taken away."""
    monkeypatch.setenv("KVSERVE_KERNEL", "gemv")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kwargs)
    return llm, record_decode_steps(llm, fast)


def _generate(llm, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return greedy_ids(llm, prompts, max_tokens)


@pytest.mark.parametrize("name,block_size", [("llama", 16), ("qwen2", 7),
                                             ("mistral_window", 7), ("qwen2_hybrid", 16)])
def test_one_call_decode_matches_transformers(name, block_size, decode_checkpoints, monkeypatch):
    """Four prompts (three longer than the window), each with its own length of output, so
    that steps run 4, 3, 2 and 1 sequences, all through the one-call path; transformers'
    greedy tokens, one prompt at a time."""
    path = decode_checkpoints[name]
    prompts = random_prompts([3, 17, 40, 70], 512, seed=5)
    expected = hf_greedy(path, prompts, max(MAX_TOKENS))
    llm, seen = _engine(path, monkeypatch, block_size=block_size)
    got = _generate(llm, prompts)
    assert got == [want[:t] for want, t in zip(expected, MAX_TOKENS)]
    assert set(seen["rows"]) == {1, 2, 3, 4}


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_hybrid"])
def test_one_call_decode_equals_the_layer_path_bit_for_bit(name, decode_checkpoints, monkeypatch):
    """The same workload with and without the path: every logit equal, not just the argmax (a
    wrong pointer into memory that still holds similar values would pass a greedy check)."""
    prompts = random_prompts([3, 17, 40, 70], 512, seed=6)
    fast, fast_seen = _engine(decode_checkpoints[name], monkeypatch, block_size=7)
    slow, slow_seen = _engine(decode_checkpoints[name], monkeypatch, fast=False, block_size=7)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert fast_seen["rows"] and len(fast_seen["logits"]) == len(slow_seen["logits"])
    for a, b in zip(fast_seen["logits"], slow_seen["logits"]):
        assert torch.equal(a, b)


def test_steps_it_cannot_serve_take_the_layer_path(decode_checkpoints, monkeypatch):
    """Steps of at most four tokens that hold a prefill chunk (a budget of 4 tokens: chunked
    prefill beside running decodes) are left to the layer-by-layer path; the decode-only
    steps run in one call; the same tokens as transformers either way."""
    path = decode_checkpoints["llama"]
    prompts = random_prompts([5, 9, 30, 33, 61, 64], 512, seed=9)
    expected = hf_greedy(path, prompts, 12)
    llm, seen = _engine(path, monkeypatch, block_size=16, max_num_batched_tokens=4)
    assert _generate(llm, prompts, [12] * len(prompts)) == expected
    assert seen["left"] > 0 and seen["rows"]  # steps with prefill rows; decode-only steps


def test_layer_path_steps_between_one_call_steps(decode_checkpoints, monkeypatch):
    """Short prompts one after another: each prefill (<= 4 rows, so the same GEMV ops, but the
    layer path) runs between one-call decode steps on the same bound ops; every continuation
    still equals transformers'."""
    path = decode_checkpoints["llama"]
    prompts = random_prompts([3, 2, 4, 3], 512, seed=13)
    expected = hf_greedy(path, prompts, 12)
    llm, seen = _engine(path, monkeypatch, block_size=16)
    for prompt, want in zip(prompts, expected):
        assert _generate(llm, [prompt], [12]) == [want]
    assert seen["left"] >= len(prompts) and len(seen["rows"]) >= len(prompts) * 11


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
    dict(bounded_kv_policy="h2o", bounded_kv_budget=24, bounded_kv_observation_window=4)],
    ids=["int8", "fp8", "h2o"])
def test_caches_it_must_not_serve_stay_on_the_layer_path(kwargs, decode_checkpoints, monkeypatch):
    """A quantized cache (stored through its codec) and H2O (every decode records its
    attention weights) with the one-call path built: it declines every step, and the tokens
    equal the engine's without the path."""
    prompts = random_prompts([3, 17, 40, 70], 512, seed=7)
    fast, seen = _engine(decode_checkpoints["llama"], monkeypatch, block_size=8, **kwargs)
    slow, _ = _engine(decode_checkpoints["llama"], monkeypatch, fast=False, block_size=8, **kwargs)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert seen["rows"] == [] and seen["left"] > 0


def test_qk_norm_models_stay_on_the_layer_path(monkeypatch, tmp_path):
    """Qwen3's q/k norms sit between the projection and RoPE: no one-call path is built."""
    monkeypatch.setenv("KVSERVE_KERNEL", "gemv")
    path = make_hf_checkpoint("qwen3", tmp_path / "qwen3")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.model.decode_step is None
