"""The one-call decode step on quantized weights (kvserve/layers/quant_decode.py): every logit
equal to the layer-by-layer path's with the path taken away (bit for bit: a wrong pointer into
memory that still holds similar values would pass a greedy check), over 1 to 4 running
sequences, blocks of 16 and 7, a sliding window and a hybrid model; the steps and models it
must leave to the layer path. Its accuracy against an independent reference is the layer
path's (tests/test_quantize_at_load.py's batch-1 check against transformers on the
dequantized blocks, tests/test_gguf.py's demo, which now run through it).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_checkpoint
from helpers import greedy_ids, random_prompts, record_decode_steps

from kvserve import LLM
from kvserve.attention import cpu_paged
from kvserve.kernels.cpu import gemv, qdecode, qgemv

pytestmark = pytest.mark.skipif(
    gemv.load() is None or qgemv.load() is None or qdecode.load() is None
    or cpu_paged.load_kernel() is None, reason="the C++ kernels could not be built")

MAX_TOKENS = (5, 9, 13, 17)  # one per prompt: steps with 4, 3, 2, then 1 running sequence


def _engine(path, quantization: str, fast: bool = True, **kwargs) -> tuple[LLM, dict]:
    """A quantize-at-load engine recording the rows of each step the path ran, the steps it
    left, and every logits tensor; `fast=False`: the path taken away."""
    llm = LLM(model=str(path), dtype="float32", quantization=quantization, max_model_len=256,
              **kwargs)
    return llm, record_decode_steps(llm, fast)


def _generate(llm, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return greedy_ids(llm, prompts, max_tokens)


@pytest.mark.parametrize("name,quantization,block_size", [
    ("llama", "q8_0", 16), ("qwen2", "q4_0", 7), ("llama", "q4_k", 7),
    ("mistral_window", "q4_1", 7), ("qwen2_hybrid", "q8_0", 16)])
def test_equals_the_layer_path_bit_for_bit(name, quantization, block_size, decode_checkpoints):
    prompts = random_prompts([3, 17, 40, 70], 512, seed=6)
    fast, fast_seen = _engine(decode_checkpoints[name], quantization, block_size=block_size)
    slow, slow_seen = _engine(decode_checkpoints[name], quantization, fast=False,
                              block_size=block_size)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert set(fast_seen["rows"]) == {1, 2, 3, 4}
    assert len(fast_seen["logits"]) == len(slow_seen["logits"])
    for a, b in zip(fast_seen["logits"], slow_seen["logits"]):
        assert torch.equal(a, b)


def test_default_gguf_model_runs_it():
    """SmolLM2's Q4_1 file: every projection is blocks, so its decode steps run in one call."""
    from gguf_files import smollm2_path

    llm = LLM(model=str(smollm2_path()), max_model_len=128)
    assert llm.engine.runner.model.decode_step is not None


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_dtype="int8"),
    dict(bounded_kv_policy="h2o", bounded_kv_budget=24, bounded_kv_observation_window=4),
    dict(max_num_batched_tokens=4)], ids=["int8", "h2o", "chunked-prefill"])
def test_steps_it_must_not_serve_take_the_layer_path(kwargs, decode_checkpoints):
    """A quantized cache (stored through its codec), H2O (decodes record attention weights)
    and steps that hold prefill rows: declined, and the tokens equal the engine's without
    the path."""
    prompts = random_prompts([3, 17, 40, 70], 512, seed=7)
    fast, seen = _engine(decode_checkpoints["llama"], "q8_0", block_size=8, **kwargs)
    slow, _ = _engine(decode_checkpoints["llama"], "q8_0", fast=False, block_size=8, **kwargs)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert seen["left"] > 0
    if "max_num_batched_tokens" not in kwargs:
        assert seen["rows"] == []


def test_rows_beyond_the_integer_kernel_limit_take_the_layer_path(decode_checkpoints, monkeypatch):
    """KVSERVE_KERNEL=qrows=2: the layer path runs 3 and 4 rows on dequantized weights, so the
    one-call step (the integer kernel) serves 1 and 2 only."""
    from kvserve.layers import kernel_choice

    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=2")
    prompts = random_prompts([3, 17, 40, 70], 512, seed=8)
    fast, seen = _engine(decode_checkpoints["qwen2"], "q8_0", block_size=16)
    slow, _ = _engine(decode_checkpoints["qwen2"], "q8_0", fast=False, block_size=16)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert set(seen["rows"]) == {1, 2}


def test_models_it_cannot_serve_get_no_step(tmp_path):
    """Qwen3's q/k norms sit between the projection and RoPE: no one-call step is built."""
    qwen3 = make_hf_checkpoint("qwen3", tmp_path / "qwen3")
    llm = LLM(model=str(qwen3), dtype="float32", quantization="q8_0", max_model_len=128)
    assert llm.engine.runner.model.decode_step is None


def test_stacked_qkv_of_a_q4_k_m_like_file(tmp_path):
    """A GGUF whose fused qkv mixes two block types (Q4_1 q/k, Q8_0 v: a kernel call per
    part, each into its columns): the one-call step serves it, bit for bit the layer
    path's."""
    from gguf_files import requantize_mixed, smollm2_path
    from test_quant_kquants import _q4_k_m_like

    from kvserve.layers.quant_linear import StackedQuantWeight

    mixed = requantize_mixed(smollm2_path(), tmp_path / "mix.gguf", _q4_k_m_like)
    prompts = random_prompts([3, 17, 40, 70], 49152, seed=9)
    fast, fast_seen = _engine(mixed, "gguf", block_size=16)
    assert isinstance(fast.engine.model.layers[0].quant_weights["qkv_proj"], StackedQuantWeight)
    slow, slow_seen = _engine(mixed, "gguf", fast=False, block_size=16)
    assert _generate(fast, prompts) == _generate(slow, prompts)
    assert set(fast_seen["rows"]) == {1, 2, 3, 4}
    for a, b in zip(fast_seen["logits"], slow_seen["logits"]):
        assert torch.equal(a, b)
