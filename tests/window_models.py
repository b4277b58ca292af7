"""The tiny windowed models and greedy settings that tests/test_window_memory.py and
tests/test_hybrid_memory.py both build their checkpoints from (config keyword arguments for
transformers' Mistral / Qwen2 / Gemma 3 configs)."""

from helpers import kv_bytes_per_token, random_prompts

from kvserve import LLM, SamplingParams

VOCAB = 256
WINDOW = 32
NEW_TOKENS = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
               bos_token_id=0, eos_token_id=2, pad_token_id=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(lengths, seed=0):
    return random_prompts(lengths, VOCAB, seed)


def window_llm(path, **kwargs) -> LLM:
    """An fp32 engine over `path`; `num_blocks` sizes the pool in blocks of every layer (the
    keep-everything unit), whatever layout the engine then picks."""
    blocks = kwargs.pop("num_blocks", None)
    if blocks is not None:
        kwargs["kv_cache_memory_bytes"] = blocks * kwargs["block_size"] * kv_bytes_per_token(path)
    return LLM(model=str(path), dtype="float32", max_model_len=512, **kwargs)
