"""The engine with attention_backend="triton" end to end: greedy tokens equal transformers'.

On a CPU the kernels run through Triton's interpreter (slow, so prompts are short); the same
tests run on the GPU when there is one. Covers a cold batch, chunked prefill mixed with decodes,
a prefix-cache hit (cached prefix + extend) and a copy-on-write of a partly matched block."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from helpers import generate_checked, hf_greedy, kv_bytes_per_token, random_prompts  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 64 * 1024**2)
    return LLM(model=str(path), dtype="float32", max_model_len=256, attention_backend="triton",
               device=DEVICE, enforce_eager=True, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_greedy_matches_transformers(arch, hf_checkpoints):
    prompts = random_prompts([1, 5, 18, 33], 512, seed=11)
    expected = hf_greedy(hf_checkpoints[arch], prompts, NEW_TOKENS)
    # Chunks of 24 tokens: the 33-token prompt is prefilled in two steps, next to decodes.
    llm = _llm(hf_checkpoints[arch], block_size=4, max_num_batched_tokens=24)
    assert type(llm.engine.backend).__name__ == "TritonAttentionBackend"
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_triton_engine_prefix_hit_and_copy_on_write(hf_checkpoints):
    path = hf_checkpoints["qwen2"]
    base = random_prompts([22], 512, seed=12)[0]
    # Shares 14 tokens with `base`: three full blocks of 4 hit, and the match ends inside the
    # fourth block, which is served by copying it (copy-on-write).
    other = base[:14] + random_prompts([5], 512, seed=13)[0]
    expected = hf_greedy(path, [base, other], NEW_TOKENS)
    llm = _llm(path, block_size=4)
    copies: list[tuple[list[int], list[int]]] = []
    backend_copy = llm.engine.backend.copy_blocks

    def spy(src: list[int], dst: list[int]) -> None:
        copies.append((list(src), list(dst)))
        backend_copy(src, dst)

    llm.engine.backend.copy_blocks = spy
    first = generate_checked(llm, [{"prompt_token_ids": base}], GREEDY)[0]
    second = generate_checked(llm, [{"prompt_token_ids": other}], GREEDY)[0]
    assert first.outputs[0].token_ids == expected[0]
    assert second.outputs[0].token_ids == expected[1]
    assert second.num_cached_tokens >= 12
    assert any(src for src, _ in copies), "no copy-on-write happened"


def test_triton_engine_loads_prefixes_from_a_storage_tier(hf_checkpoints, tmp_path):
    """Tier saves and loads go through the backend's read_blocks/write_blocks: a prefix evicted
    from a small pool to disk comes back and decodes to transformers' tokens."""
    path = hf_checkpoints["qwen2"]
    docs = random_prompts([40, 40], 512, seed=14)
    prompts = [docs[0] + [5, 6], docs[1] + [7, 8], docs[0] + [9, 10]]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    # 13 blocks of 4 tokens: each 48-token request evicts the one before
    llm = _llm(path, block_size=4, kv_cache_memory_bytes=13 * 4 * kv_bytes_per_token(path),
               kv_tier_config={"chunk_size": 8, "local_cpu": False, "local_disk": str(tmp_path),
                               "max_local_disk_size": 0.01})
    outs = [generate_checked(llm, [{"prompt_token_ids": p}], GREEDY)[0] for p in prompts[:2]]
    llm.engine.tiers.flush()
    outs += generate_checked(llm, [{"prompt_token_ids": prompts[2]}], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.hit_tokens["disk"] >= 32 and stats.hit_tokens["device"] + \
        stats.hit_tokens["disk"] >= 40, stats
    llm.engine.shutdown()


def test_attention_backend_config():
    assert EngineConfig(device="cpu").attention_backend == "torch"
    assert EngineConfig(device="cpu", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    if not torch.cuda.is_available():
        assert EngineConfig().device == "cpu"


def test_graph_runner_padding_and_static_buffers(hf_checkpoints):
    """The CUDA-graph runner's host side on the CPU: bucketing, padding rows (slot -1, length 1),
    static buffers and per-bucket split counts, with 'replay' running the captured forward
    eagerly on those buffers. Greedy tokens must still equal transformers'."""
    from kvserve.worker.cuda_graphs import CUDAGraphRunner

    class EagerReplay(CUDAGraphRunner):
        def capture(self, bs: int) -> None:
            self._inputs[:2, :bs].zero_()
            self._inputs[2, :bs].fill_(-1)
            self._inputs[3, :bs].fill_(1)
            state = self._state(bs)

            def forward() -> None:
                self._outputs[bs] = self.model(
                    self._inputs[0, :bs], self._inputs[1, :bs],
                    lambda layer, q, k, v: self.backend.attend(layer, q, k, v, state))

            self._graphs[bs] = forward  # type: ignore[assignment]
            self.captured.append(bs)

        def _replay(self, bs: int) -> None:
            self._graphs[bs]()  # type: ignore[operator]

    path = hf_checkpoints["qwen3"]
    prompts = random_prompts([3, 9, 14], 512, seed=14)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = _llm(path, block_size=4, max_num_seqs=6)
    engine = llm.engine
    runner = EagerReplay(engine.model, engine.backend, 6, engine.config.max_model_len)
    runner.captured = []
    engine.runner.graphs = runner
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert runner.captured == [4], "three decodes should run padded to the bucket of 4"


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_triton_engine_quantized_cache_matches_the_torch_backend(kv_dtype, hf_checkpoints):
    """The engine on a quantized KV cache: the Triton backend (dequantizing in its kernels)
    gives the torch backend's greedy tokens, across chunked prefill, decodes and a prefix hit
    ending inside a block (copy-on-write)."""
    path = hf_checkpoints["qwen3"]
    prompts = random_prompts([5, 33], 512, seed=14)
    prompts.append(prompts[1][:14] + random_prompts([5], 512, seed=15)[0])
    kwargs = {"kv_cache_dtype": kv_dtype, "block_size": 4, "max_num_batched_tokens": 24}
    want = LLM(model=str(path), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=64 * 1024**2, **kwargs)
    got = _llm(path, **kwargs)
    for llm in (want, got):
        first = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)
        again = generate_checked(llm, [{"prompt_token_ids": prompts[2]}], GREEDY)
        llm.tokens = [o.outputs[0].token_ids for o in first + again]
        assert again[0].num_cached_tokens == 14
    assert got.tokens == want.tokens
