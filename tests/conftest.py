"""Shared fixtures: checkpoints made by transformers itself (the independent reference) and by
kvserve's make-model, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import save_random_checkpoint

torch.set_num_threads(2)

HF_VOCAB = 512


def _hf_config(arch: str):
    import transformers

    common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                        rope_theta=500000.0, attention_bias=True,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                                        rope_theta=1e6)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, rope_theta=1e4,
                                          sliding_window=None)
    if arch == "phi3":  # fused qkv / gate_up in the checkpoint; half of each head rotates
        return transformers.Phi3Config(**common, tie_word_embeddings=False, sliding_window=None,
                                       rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5})
    if arch == "olmo2":  # norms after attention and the MLP, q/k norms over all heads
        return transformers.Olmo2Config(**common, tie_word_embeddings=False, rope_theta=1e4)
    if arch == "granite":  # embedding / residual / attention multipliers, scaled logits
        return transformers.GraniteConfig(**common, tie_word_embeddings=True, rope_theta=1e4,
                                          embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.1, logits_scaling=6.0)
    if arch == "smollm3":  # the second layer without RoPE
        return transformers.SmolLM3Config(**common, tie_word_embeddings=True,
                                          no_rope_layer_interval=2,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e4})
    if arch == "qwen3_moe":  # 8 experts, top 2 renormalised, q/k norms
        return transformers.Qwen3MoeConfig(**common, tie_word_embeddings=False, rope_theta=1e6,
                                           head_dim=16, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=48, norm_topk_prob=True)
    if arch == "mixtral":  # 4 experts of intermediate_size, top 2
        return transformers.MixtralConfig(**common, tie_word_embeddings=False, rope_theta=1e6,
                                          num_local_experts=4, num_experts_per_tok=2)
    if arch == "gemma2":  # soft-capped attention and logits (its sliding layers' windows:
        # longer than the prompts here; tests/test_window_parity.py slides them)
        return transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=5.0,
                                         final_logit_softcapping=30.0, sliding_window=4096)
    raise ValueError(arch)


# The architectures `hf_checkpoints` holds, one checkpoint each.
HF_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "granite", "smollm3",
            "qwen3_moe", "mixtral", "gemma2")


def make_hf_checkpoint(arch: str, out: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint written by transformers' own save_pretrained."""
    return save_random_checkpoint(_hf_config(arch), out, seed)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is as fast as two, and does not stall when the machine
    is busy (two threads spinning at each GEMM's barrier on two shared cores can be 50x
    slower). A module asks for it with `pytestmark = pytest.mark.usefixtures(...)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(arch, root / arch) for arch in HF_ARCHS}


DECODE_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0,
                     eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def decode_checkpoints(tmp_path_factory) -> dict:
    """The one-call decode tests' models (test_cpu_decode, test_quant_decode): llama (biases,
    untied head) and qwen2 (tied) as `make_hf_checkpoint` makes them; Mistral with a window
    of 8; a Qwen2 hybrid (a sliding and a full layer: two KV groups, two tables)."""
    import transformers

    root = tmp_path_factory.mktemp("cpu_decode")
    return {
        "llama": make_hf_checkpoint("llama", root / "llama"),
        "qwen2": make_hf_checkpoint("qwen2", root / "qwen2"),
        "mistral_window": save_random_checkpoint(
            transformers.MistralConfig(**DECODE_COMMON, tie_word_embeddings=False,
                                       rope_theta=1e4, sliding_window=8),
            root / "mistral_window"),
        "qwen2_hybrid": save_random_checkpoint(
            transformers.Qwen2Config(**DECODE_COMMON, tie_word_embeddings=True, rope_theta=1e6,
                                     use_sliding_window=True, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"]),
            root / "qwen2_hybrid"),
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from kvserve.model_loader.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "qwen2-tiny", arch="qwen2", size="tiny")


@pytest.fixture(autouse=True)
def _check_invariants_after_every_step(monkeypatch):
    """Every engine step in every test is followed by the engine's invariant check."""
    from kvserve.engine.llm_engine import LLMEngine

    original = LLMEngine.step

    def checked_step(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        self.check_invariants()
        return outputs

    monkeypatch.setattr(LLMEngine, "step", checked_step)


@pytest.fixture
def redis_server():
    """A fresh redis-server on a free port (tests/redis_server.py). Missing redis-server fails
    the test (KVSERVE_SKIP_REDIS=1 skips it instead)."""
    from redis_server import start_redis

    server = start_redis()
    yield server
    server.close()
