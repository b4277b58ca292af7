"""A long prompt is computed a bounded chunk per step (long_prefill_token_threshold, vLLM's
name; issue 48, item 2): on the CPU a whole 8,192-token prompt in one step held ~300 MB of
float32 activations beside its KV. The chunks change no output, and the step's budget still
takes the other requests beside a capped prompt."""

from __future__ import annotations

import pytest
from helpers import greedy_ids, random_prompts

from kvserve import LLM
from kvserve.config import CPU_LONG_PREFILL_TOKENS, EngineConfig


def test_defaults_and_checks():
    cpu = EngineConfig(device="cpu")
    cpu.finalize(4096)
    assert cpu.long_prefill_token_threshold == CPU_LONG_PREFILL_TOKENS
    off = EngineConfig(device="cpu", long_prefill_token_threshold=0)
    off.finalize(4096)
    assert off.long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(device="cpu", long_prefill_token_threshold=-1)


def _llm(model_dir, threshold: int) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
               block_size=16, max_num_batched_tokens=64, long_prefill_token_threshold=threshold,
               enable_prefix_caching=False)


def test_prompts_are_capped_per_step_and_outputs_unchanged(tiny_model_dir, one_torch_thread):
    prompts = random_prompts([50, 40, 9], 200, seed=3)
    capped = _llm(tiny_model_dir, 16)
    chunks: list[list[int]] = []
    original = capped.engine.scheduler.schedule

    def spy():
        batch = original()
        chunks.append(list(batch.num_new_tokens))
        return batch

    capped.engine.scheduler.schedule = spy
    got = greedy_ids(capped, prompts, [6, 6, 6])
    assert max(max(c) for c in chunks if c) == 16
    assert any(len([n for n in c if n > 1]) > 1 for c in chunks), \
        "a capped prompt left the rest of the budget unused"
    assert got == greedy_ids(_llm(tiny_model_dir, 0), prompts, [6, 6, 6])
