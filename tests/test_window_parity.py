"""Sliding-window models through the engine against transformers on the same weights (issue 15,
acceptance 1): greedy tokens equal `generate`'s, and every sampled row's float32 logits (the
prompt's last position and each decode) within 1e-4 of transformers' forward, with windows of
32-48 tokens and prompts up to eight windows long, block sizes 16 and 7, chunked prefill,
preemption and prefix-cache hits.

Four configs cover every way a config declares windows: Mistral's single `sliding_window` (all
layers), Qwen2's `layer_types` mixing sliding and full layers, Qwen3's `use_sliding_window` +
`max_window_layers`, and the hybrid Gemma 3 (text), local and global layers. A control checks
that the reference itself applies the window (its logits past the window differ from the same
weights without one), so a test here can fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import generate_checked, hf_greedy, kv_bytes_per_token, save_random_checkpoint

from kvserve import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 512
NEW_TOKENS = 10
# Around and far past the windows (32 and 48): below, at, and just over a window, then several.
LENGTHS = [5, 31, 32, 33, 49, 100, 150, 250]
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
               bos_token_id=0, eos_token_id=2, pad_token_id=0)


def _configs():
    return {
        "mistral": transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=32,
                                              tie_word_embeddings=False, rope_theta=1e4),
        "qwen2-layer-types": transformers.Qwen2Config(
            **_COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=True, rope_theta=1e6),
        "qwen3-max-window-layers": transformers.Qwen3Config(
            **_COMMON, num_hidden_layers=2, head_dim=32, use_sliding_window=True,
            sliding_window=48, max_window_layers=1, tie_word_embeddings=False),
        # The hybrid architecture: local layers over 32 tokens with their own RoPE base, a
        # global layer with linear-scaled RoPE, soft-capped logits, query_pre_attn_scalar.
        "gemma3": transformers.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=3, head_dim=32, sliding_window=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=30.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        # Gemma 2: alternating sliding layers over 32 tokens, soft-capped attention scores
        # (the gather path: the paged kernel has no cap) and logits
        "gemma2": transformers.Gemma2Config(
            **_COMMON, num_hidden_layers=3, head_dim=16, sliding_window=32,
            query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    }


CONFIGS = list(_configs())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {name: save_random_checkpoint(cfg, root / name, seed=i, perturb_norms=True)
            for i, (name, cfg) in enumerate(_configs().items())}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def references(checkpoints):
    return {name: (_prompts(i), hf_greedy(path, _prompts(i), NEW_TOKENS))
            for i, (name, path) in enumerate(checkpoints.items())}


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SCENARIOS = {
    "block16": dict(block_size=16),
    "block7": dict(block_size=7),
    "chunked": dict(block_size=16, max_num_batched_tokens=40),
    # 34 blocks of 8 = 272 tokens: the longest request alone needs most of it (its prompt at
    # once; Mistral's requests then hold only their windows, so a bigger pool would not preempt).
    "preempt": dict(block_size=8, kv_cache_memory_bytes="34 blocks"),
}


def _llm(path, **kwargs) -> LLM:
    if kwargs.get("kv_cache_memory_bytes") == "34 blocks":
        kwargs["kv_cache_memory_bytes"] = 34 * kwargs["block_size"] * kv_bytes_per_token(path)
    return LLM(model=str(path), dtype="float32", max_model_len=512, **kwargs)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_windowed_greedy_matches_transformers(name, scenario, checkpoints, references):
    prompts, expected = references[name]
    llm = _llm(checkpoints[name], **SCENARIOS[scenario])
    assert any(w is not None for w in llm.engine.model_config.windows)
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool forced no preemption"


@pytest.mark.parametrize("name", CONFIGS)
def test_windowed_greedy_after_prefix_hits(name, checkpoints):
    """A long shared document (five windows) computed once, then requests that extend it read
    it from the cache (including a match that ends inside a block) and must still match."""
    path = checkpoints[name]
    rng = random.Random(5)
    doc = [rng.randrange(3, VOCAB) for _ in range(165)]
    prompts = [doc + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 20, 41)]
    prompts.append(doc[:150])  # ends inside a block of 16: copy-on-write of a partial hit
    expected = hf_greedy(path, [doc] + prompts, NEW_TOKENS)
    llm = _llm(path, block_size=16)
    first = generate_checked(llm, [{"prompt_token_ids": doc}], GREEDY)
    rest = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 144 for o in rest), [o.num_cached_tokens for o in rest]


def _hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_windowed_logits_within_1e4(name, checkpoints, references):
    """Every sampled row (each prompt's last position, then each decode step) against
    transformers' forward over prompt + generated tokens, float32, within 1e-4; and the same
    weights without a window give different logits there (the window matters)."""
    prompts, expected = references[name]
    path = checkpoints[name]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full_cfg = transformers.AutoConfig.from_pretrained(path)
    full_cfg.sliding_window = 1 << 20  # wider than any sequence here: full attention
    no_window = transformers.AutoModelForCausalLM.from_pretrained(path, config=full_cfg,
                                                                  dtype=torch.float32)

    llm = _llm(path, block_size=7, max_num_batched_tokens=64)
    runner = llm.engine.runner
    captured: dict[str, list[torch.Tensor]] = {}
    original = runner.forward

    def spy(seqs):
        out = original(seqs)
        for j, i in enumerate(out.sampled):
            captured.setdefault(seqs[i].request_id, []).append(out.logits[j].clone())
        return out

    runner.forward = spy
    ids = [llm.engine.add_request({"prompt_token_ids": p}, GREEDY) for p in prompts]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for rid, p, gen in zip(ids, prompts, expected):
        rows = captured[rid]
        assert len(rows) == NEW_TOKENS
        seq = p + gen
        want = _hf_logits(ref_model, seq)[len(p) - 1: len(seq) - 1]
        got = torch.stack(rows)
        assert got.dtype == torch.float32
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (name, len(p), err)
        if len(seq) > 60:  # far enough past every window that it must change the logits
            diff = (_hf_logits(no_window, seq)[len(p) - 1: len(seq) - 1] - want).abs().max()
            assert diff > 1e-3, "the reference ignores the window: this test could not fail"
