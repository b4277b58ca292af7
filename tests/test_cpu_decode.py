"""The one-call CPU decode (kvserve/model/cpu_decode.py): decode steps of up to four sequences
run every layer in one C++ call. Checked against transformers' greedy continuations (every
sequence and step count it serves: 1-4 running, blocks of 16 and 7, a Mistral-style window),
and for the steps it must leave to the layer-by-layer path."""

from __future__ import annotations

import pytest
from helpers import generate_checked, hf_greedy, random_prompts

from kvserve import LLM, SamplingParams
from kvserve.model import gemv
from kvserve.model.attention import cpu_paged

pytestmark = pytest.mark.skipif(gemv.load() is None or cpu_paged.load_kernel() is None,
                                reason="the C++ kernels could not be built")

NEW_TOKENS = 12


def _engine(path, monkeypatch, **kwargs) -> tuple[LLM, dict]:
    """An engine whose every projection runs the GEMV at <= 4 rows (the plan the one-call path
    needs; `auto` picks MKL on these tiny shapes), counting the steps the path ran and left."""
    monkeypatch.setenv("KVSERVE_GEMM", "gemv")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kwargs)
    fast = llm.engine.runner.model._fast_decode
    assert fast is not None, "the one-call decode was not set up"
    counts = {"ran": 0, "left": 0}
    inner = fast.run

    def counted(*args):
        result = inner(*args)
        counts["ran" if result is not None else "left"] += 1
        return result

    fast.run = counted
    return llm, counts


@pytest.mark.parametrize("arch,block_size", [("llama", 16), ("qwen2", 7), ("mistral", 16)])
def test_one_call_decode_matches_transformers(arch, block_size, hf_checkpoints, monkeypatch):
    """Four prompts of different lengths: steps with 4, then fewer running sequences, all
    through the one-call path; transformers' greedy tokens, one prompt at a time."""
    path = hf_checkpoints[arch]
    prompts = random_prompts([3, 17, 40, 70], 512, seed=5)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm, counts = _engine(path, monkeypatch, block_size=block_size)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                           ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert counts["ran"] >= NEW_TOKENS - 1


def test_steps_it_cannot_serve_take_the_layer_path(hf_checkpoints, monkeypatch):
    """Steps of at most four tokens that hold a prefill chunk (a budget of 4 tokens: chunked
    prefill beside running decodes) are left to the layer-by-layer path; the decode-only
    steps run in one call; the same tokens as transformers either way."""
    path = hf_checkpoints["llama"]
    prompts = random_prompts([5, 9, 30, 33, 61, 64], 512, seed=9)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm, counts = _engine(path, monkeypatch, block_size=16, max_num_batched_tokens=4)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                           ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert counts["left"] > 0  # steps with prefill rows
    assert counts["ran"] > 0  # decode-only steps


def test_qk_norm_models_stay_on_the_layer_path(hf_checkpoints, monkeypatch):
    """Qwen3's q/k norms sit between the projection and RoPE: no one-call path is built."""
    monkeypatch.setenv("KVSERVE_GEMM", "gemv")
    llm = LLM(model=str(hf_checkpoints["qwen3"]), dtype="float32", max_model_len=128)
    assert llm.engine.runner.model._fast_decode is None


def test_layer_path_steps_between_one_call_steps(hf_checkpoints, monkeypatch):
    """Short prompts one after another: each prefill (<= 4 rows, so the same GEMV ops, but the
    layer path) runs between one-call decode steps on the same bound ops; every continuation
    still equals transformers'."""
    path = hf_checkpoints["llama"]
    prompts = random_prompts([3, 2, 4, 3], 512, seed=13)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm, counts = _engine(path, monkeypatch, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, want in zip(prompts, expected):
        out = generate_checked(llm, [{"prompt_token_ids": prompt}], params)[0]
        assert out.outputs[0].token_ids == want
    assert counts["left"] >= len(prompts) and counts["ran"] >= len(prompts) * (NEW_TOKENS - 1)
