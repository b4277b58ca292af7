"""Acceptance 1: greedy token ids equal transformers' `generate` on the same weights, across
architectures (Phi-3 and OLMo 2: issue 30's two added through the registry; Granite 3,
SmolLM3, Qwen3-MoE, Mixtral and Gemma 2: issue 47's), block sizes, chunked prefill and
preemption; first-token logits within 1e-4."""

from __future__ import annotations

import pytest
import torch
from helpers import (first_token_logits, generate_checked, hf_greedy, kv_bytes_per_token,
                     random_prompts)

from kvserve import LLM, SamplingParams

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "granite", "smollm3",
         "qwen3_moe", "mixtral", "gemma2")
LENGTHS = [1, 3, 17, 40, 64, 129, 200, 310]  # mixed, 1 to 300+
NEW_TOKENS = 10
VOCAB = 512


@pytest.fixture(scope="module")
def references(hf_checkpoints) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per architecture: the prompts and transformers' greedy continuations, one prompt at a time
    (no padding, so the reference is exact)."""
    refs = {}
    for arch in ARCHS:
        path = hf_checkpoints[arch]
        prompts = random_prompts(LENGTHS, VOCAB, seed=ARCHS.index(arch))
        refs[arch] = (prompts, hf_greedy(path, prompts, NEW_TOKENS))
    return refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

SCENARIOS = {
    "block16": dict(block_size=16),
    "block1": dict(block_size=1),
    "block7": dict(block_size=7),
    "chunked": dict(block_size=16, max_num_batched_tokens=48),
    # 40 blocks of 8 = 320 tokens: the longest request alone needs all of it.
    "preempt": dict(block_size=8, kv_cache_memory_bytes="40 blocks"),
}


def _kwargs(arch_dir, scenario: dict) -> dict:
    kwargs = dict(scenario)
    if kwargs.get("kv_cache_memory_bytes") == "40 blocks":
        kwargs["kv_cache_memory_bytes"] = 40 * kwargs["block_size"] * kv_bytes_per_token(arch_dir)
    return kwargs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(arch, scenario, hf_checkpoints, references):
    prompts, expected = references[arch]
    llm = LLM(model=str(hf_checkpoints[arch]), dtype="float32", max_model_len=512,
              **_kwargs(hf_checkpoints[arch], SCENARIOS[scenario]))
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool forced no preemption"
    if scenario == "chunked":
        assert llm.engine.config.max_num_batched_tokens == 48


def _hf_last_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits at each prompt's last position, each prompt alone."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_first_token_logits_match(arch, hf_checkpoints, references):
    """The logits our paged path produces for each prompt's last position (the first generated
    token), batched, against transformers' forward on each prompt alone."""
    prompts, _ = references[arch]
    ref = _hf_last_logits(hf_checkpoints[arch], prompts)
    llm = LLM(model=str(hf_checkpoints[arch]), dtype="float32", max_model_len=512, block_size=16)
    captured = first_token_logits(llm, [prompts])
    assert len(captured) == len(prompts)
    for p, want in zip(prompts, ref):
        got = captured[tuple(p)]
        assert got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "phi3", "olmo2"])
def test_equal_length_prompts_batched_attention_matches(arch, hf_checkpoints):
    """Fresh prompts of one length in one step share one attention call (a run of prefills);
    runs of two lengths, a prompt alone between them, and a sequence with a cached prefix
    (never in a run): first-token logits against transformers' forward on each prompt."""
    from kvserve.attention import torch_backend

    prompts = random_prompts([17] * 4 + [5] + [40] * 3, VOCAB, seed=21)
    prompts.append(prompts[0][:12] + prompts[5][:9])  # shares 12 tokens with the first
    ref = _hf_last_logits(hf_checkpoints[arch], prompts)
    llm = LLM(model=str(hf_checkpoints[arch]), dtype="float32", max_model_len=512, block_size=4)
    runs: list[int] = []
    real_runs = torch_backend._prefill_runs

    def spy_runs(plans):
        out = real_runs(plans)
        runs.extend(len(r) for r in out)
        return out

    torch_backend._prefill_runs = spy_runs
    try:  # the first prompt alone first: its prefix is cached for the last one
        captured = first_token_logits(llm, [prompts[:1], prompts[1:]])
    finally:
        torch_backend._prefill_runs = real_runs
    assert max(runs) >= 3, runs  # the equal-length prompts did share a call
    for p, want in zip(prompts, ref):
        got = captured[tuple(p)]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
