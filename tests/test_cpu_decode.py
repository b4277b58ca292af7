"""The one-call CPU decode (kvserve/layers/fast_decode.py): decode steps of up to four sequences
run every layer in one C++ call. Checked against transformers' greedy continuations (1 to 4
running sequences, blocks of 16 and 7, a sliding window, a hybrid model's per-group tables),
bit for bit against the layer-by-layer path it replaces, and for the steps and caches it must
leave to that path."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_hf_checkpoint
from helpers import generate_checked, hf_greedy, random_prompts, save_random_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.kernels.cpu import gemv
from kvserve.attention import cpu_paged

pytestmark = pytest.mark.skipif(gemv.load() is None or cpu_paged.load_kernel() is None,
                                reason="the C++ kernels could not be built")

MAX_TOKENS = (5, 9, 13, 17)  # one per prompt: steps with 4, 3, 2, then 1 running sequence
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """llama (biases, untied head) and qwen2 (tied) as conftest makes them; Mistral with a
    window of 8; a Qwen2 hybrid (a sliding and a full layer: two KV groups, two tables)."""
    root = tmp_path_factory.mktemp("cpu_decode")
    return {
        "llama": make_hf_checkpoint("llama", root / "llama"),
        "qwen2": make_hf_checkpoint("qwen2", root / "qwen2"),
        "mistral_window": save_random_checkpoint(
            transformers.MistralConfig(**COMMON, tie_word_embeddings=False, rope_theta=1e4,
                                       sliding_window=8), root / "mistral_window"),
        "qwen2_hybrid": save_random_checkpoint(
            transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6,
                                     use_sliding_window=True, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"]),
            root / "qwen2_hybrid"),
    }


def _engine(path, monkeypatch, fast: bool = True, **kwargs) -> tuple[LLM, dict]:
    """An engine whose every projection runs the GEMV at <= 4 rows (the plan the one-call path
    needs; `auto` picks MKL on these tiny shapes), recording the rows of each step the path
    ran, the steps it left, and every logits tensor; `fast=False`: the path taken away."""
    monkeypatch.setenv("KVSERVE_GEMM", "gemv")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kwargs)
    model = llm.engine.runner.model
    assert model.decode_step is not None, "the one-call decode was not set up"
    seen = {"rows": [], "left": 0, "logits": []}
    if fast:
        inner = model.decode_step.run

        def counted(hidden, *args):
            result = inner(hidden, *args)
            if result is None:
                seen["left"] += 1
            else:
                seen["rows"].append(hidden.shape[0])
            return result

        model.decode_step.run = counted
    else:
        model.decode_step = None
    logits = model.compute_logits

    def recorded(hidden):
        out = logits(hidden)
        seen["logits"].append(out.clone())
        return out

    model.compute_logits = recorded
    return llm, seen


def _generate(llm, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
                             for t in max_tokens])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name,block_size", [("llama", 16), ("qwen2", 7),
                                             ("mistral_window", 7), ("qwen2_hybrid", 16)])
def test_one_call_decode_matches_transformers(name, block_size, checkpoints, monkeypatch):
    """Four prompts (three longer than the window), each with its own length of output, so
    that steps run 4, 3, 2 and 1 sequences, all through the one-call path; transformers'
    greedy tokens, one prompt at a time."""
    path = checkpoints[name]
    prompts = random_prompts([3, 17, 40, 70], 512, seed=5)
    expected = hf_greedy(path, prompts, max(MAX_TOKENS))
    llm, seen = _engine(path, monkeypatch, block_size=block_size)
    got = _generate(llm, prompts)
    assert got == [want[:t] for want, t in zip(expected, MAX_TOKENS)]
    assert set(seen["rows"]) == {1, 2, 3, 4}


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_hybrid"])
def test_one_call_decode_equals_the_layer_path_bit_for_bit(name, checkpoints, monkeypatch):
    """The same workload with and without the path: every logit equal, not just the argmax (a
    wrong pointer into memory that still holds similar values would pass a greedy check)."""
    prompts = random_prompts([3, 17, 40, 70], 512, seed=6)
    fast, fast_seen = _engine(checkpoints[name], monkeypatch, block_size=7)
    slow, slow_seen = _engine(checkpoints[name], monkeypatch, fast=False, block_size=7)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert fast_seen["rows"] and len(fast_seen["logits"]) == len(slow_seen["logits"])
    for a, b in zip(fast_seen["logits"], slow_seen["logits"]):
        assert torch.equal(a, b)


def test_steps_it_cannot_serve_take_the_layer_path(checkpoints, monkeypatch):
    """Steps of at most four tokens that hold a prefill chunk (a budget of 4 tokens: chunked
    prefill beside running decodes) are left to the layer-by-layer path; the decode-only
    steps run in one call; the same tokens as transformers either way."""
    path = checkpoints["llama"]
    prompts = random_prompts([5, 9, 30, 33, 61, 64], 512, seed=9)
    expected = hf_greedy(path, prompts, 12)
    llm, seen = _engine(path, monkeypatch, block_size=16, max_num_batched_tokens=4)
    assert _generate(llm, prompts, [12] * len(prompts)) == expected
    assert seen["left"] > 0 and seen["rows"]  # steps with prefill rows; decode-only steps


def test_layer_path_steps_between_one_call_steps(checkpoints, monkeypatch):
    """Short prompts one after another: each prefill (<= 4 rows, so the same GEMV ops, but the
    layer path) runs between one-call decode steps on the same bound ops; every continuation
    still equals transformers'."""
    path = checkpoints["llama"]
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
def test_caches_it_must_not_serve_stay_on_the_layer_path(kwargs, checkpoints, monkeypatch):
    """A quantized cache (stored through its codec) and H2O (every decode records its
    attention weights) with the one-call path built: it declines every step, and the tokens
    equal the engine's without the path."""
    prompts = random_prompts([3, 17, 40, 70], 512, seed=7)
    fast, seen = _engine(checkpoints["llama"], monkeypatch, block_size=8, **kwargs)
    slow, _ = _engine(checkpoints["llama"], monkeypatch, fast=False, block_size=8, **kwargs)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert seen["rows"] == [] and seen["left"] > 0


def test_qk_norm_models_stay_on_the_layer_path(monkeypatch, tmp_path):
    """Qwen3's q/k norms sit between the projection and RoPE: no one-call path is built."""
    monkeypatch.setenv("KVSERVE_GEMM", "gemv")
    path = make_hf_checkpoint("qwen3", tmp_path / "qwen3")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.model.decode_step is None
