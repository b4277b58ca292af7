"""GPU-only: the engine on CUDA (Triton kernels, CUDA graphs, bf16) against transformers.

Skipped cleanly on machines without CUDA. The kernel-level tests (tests/test_triton_kernels.py)
and the engine-level Triton tests (tests/test_triton_engine.py) also run on the GPU when there
is one; these add what only a GPU has: graph capture and replay, memory profiling, bf16 on the
device."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from helpers import generate_checked, random_prompts  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 12
POOL = 256 * 1024**2  # explicit pools: the default (90% of the GPU) per engine is wasteful here
LENGTHS = [1, 3, 17, 40, 64, 129, 200]


def _reference(path, prompts: list[list[int]], dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda")
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines of earlier tests may linger in reference cycles; their pools must not count
    against the next engine's profile."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _run(path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=POOL,
              **kwargs)
    assert llm.engine.config.device == "cuda"  # "auto" resolved to the GPU
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_greedy_matches_transformers_fp32(arch, enforce_eager, hf_checkpoints):
    prompts = random_prompts(LENGTHS, 512, seed=21)
    expected = _reference(hf_checkpoints[arch], prompts, torch.float32)
    got = _run(hf_checkpoints[arch], prompts, dtype="float32", enforce_eager=enforce_eager,
               block_size=16, max_num_batched_tokens=96)
    assert got == expected


def test_gpu_graphs_and_eager_agree_bf16(hf_checkpoints):
    """bf16 greedy can differ from transformers' own bf16 by rounding order; graphs vs eager in
    kvserve run the very same kernels, so they must agree exactly, and mostly with HF."""
    prompts = random_prompts(LENGTHS, 512, seed=22)
    path = hf_checkpoints["qwen2"]
    graphs = _run(path, prompts, dtype="bfloat16", enforce_eager=False)
    eager = _run(path, prompts, dtype="bfloat16", enforce_eager=True)
    assert graphs == eager
    expected = _reference(path, prompts, torch.bfloat16)
    first_tokens_equal = sum(g[0] == e[0] for g, e in zip(graphs, expected))
    assert first_tokens_equal >= len(prompts) - 1


def test_gpu_prefix_cache_and_copy_on_write(hf_checkpoints):
    path = hf_checkpoints["qwen3"]
    base = random_prompts([70], 512, seed=23)[0]
    other = base[:37] + random_prompts([9], 512, seed=24)[0]
    expected = _reference(path, [base, other], torch.float32)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16,
              kv_cache_memory_bytes=POOL)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = generate_checked(llm, [{"prompt_token_ids": base}], params)[0]
    second = generate_checked(llm, [{"prompt_token_ids": other}], params)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected
    assert second.num_cached_tokens >= 32


def test_gpu_kv_pool_sized_by_profile(hf_checkpoints):
    small = LLM(model=str(hf_checkpoints["qwen2"]), dtype="float32", max_model_len=512,
                gpu_memory_utilization=0.2, enforce_eager=True)
    big = LLM(model=str(hf_checkpoints["qwen2"]), dtype="float32", max_model_len=512,
              gpu_memory_utilization=0.3, enforce_eager=True)
    assert big.engine.kv.num_blocks > small.engine.kv.num_blocks > 0
    assert small.engine.backend.kv_caches[0][0].device.type == "cuda"


def test_gpu_sampling_with_seed_and_logprobs(hf_checkpoints):
    """Random sampling and logprobs take the host path; seeded requests repeat exactly."""
    llm = LLM(model=str(hf_checkpoints["qwen2"]), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=POOL)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, logprobs=2)
    a = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.outputs[0].logprobs) == 8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_tensor_parallel_matches_transformers_fp32(enforce_eager, hf_checkpoints):
    """tensor_parallel_size=2 on two GPUs (NCCL all-reduces, each rank's CUDA graphs captured
    with them): transformers' greedy tokens, as tp=1 gives them."""
    prompts = random_prompts(LENGTHS, 512, seed=22)
    path = hf_checkpoints["llama"]
    expected = _reference(path, prompts, torch.float32)
    llm = LLM(model=str(path), max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=POOL,
              dtype="float32", enforce_eager=enforce_eager, block_size=16,
              max_num_batched_tokens=96, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.engine.shutdown()
