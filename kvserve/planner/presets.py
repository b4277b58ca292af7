"""Built-in models: the published `config.json` values of well-known checkpoints.

Each preset is the subset of the model's Hugging Face `config.json` that KV and weight sizing
reads, written with the same keys, so presets and local files go through one parser
(`ModelSpec.from_hf_config`). `num_params` is the published parameter count (for the dense models,
the exact number of stored parameters; tied embeddings counted once); the tests check that the
count estimated from the shapes agrees with it, which also checks the shapes.

Sources: the `config.json` of each model's official Hugging Face repository (meta-llama, Qwen,
mistralai, deepseek-ai, google).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float16", "num_params": 6_738_415_616,
    },
    "llama-2-13b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float16", "num_params": 13_015_864_320,
    },
    "llama-2-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float16", "num_params": 68_976_648_192,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "num_params": 8_030_261_248,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "num_params": 70_553_706_496,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
        "torch_dtype": "bfloat16", "num_params": 7_615_616_512,
    },
    "qwen2.5-72b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 80,
        "torch_dtype": "bfloat16", "num_params": 72_706_203_648,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
        "torch_dtype": "bfloat16", "num_params": 596_049_920,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
        "torch_dtype": "bfloat16", "num_params": 8_190_735_360,
    },
    # Mistral-7B-v0.1: every layer attends to a 4,096-token sliding window (v0.2 and later
    # dropped the window; load their config.json to plan for them).
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_params": 7_241_732_096,
    },
    # A hybrid pattern: even layers (0, 2, ...) slide over 4,096 tokens, odd layers are global.
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "vocab_size": 256000, "max_position_embeddings": 8192, "sliding_window": 4096,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",  # the dtype it is served in
        "num_params": 9_241_705_984,
    },
    # Gemma 3 12B (its text model): five layers slide over 1,024 tokens for each global layer
    # (layers 5, 11, ...); the engine runs this architecture (Gemma3ForCausalLM).
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        # The text decoder, counted from these shapes (q/k norms included); the published
        # 12.2B adds the ~0.42B SigLIP vision tower.
        "num_params": 11_766_034_176,
    },
    # MLA: one compressed latent of kv_lora_rank (512) + qk_rope_head_dim (64) per token per
    # layer, shared by all 128 heads; num_key_value_heads (128) does not size the cache.
    "deepseek-v2": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "num_params": 236_000_000_000,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        # the main model; the published 685B adds the 14B multi-token-prediction module
        "num_params": 671_000_000_000,
    },
}

# Other spellings people type: Hugging Face repository names and the vendors' own names.
ALIASES = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "llama2-7b": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b", "llama2-13b": "llama-2-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b", "llama2-70b": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-72b": "qwen2.5-72b", "qwen/qwen2.5-72b-instruct": "qwen2.5-72b",
    "qwen/qwen3-0.6b": "qwen3-0.6b", "qwen/qwen3-8b": "qwen3-8b",
    "mistralai/mistral-7b-v0.1": "mistral-7b", "mistral-7b-v0.1": "mistral-7b",
    "google/gemma-2-9b": "gemma-2-9b", "google/gemma-3-12b-it": "gemma-3-12b",
    "google/gemma-3-12b-pt": "gemma-3-12b",
    "deepseek-ai/deepseek-v2": "deepseek-v2", "deepseek-ai/deepseek-v3": "deepseek-v3",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def lookup(name: str) -> tuple[str, dict[str, Any]] | None:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return key, PRESETS[key]
    return None


# GPUs by the total memory CUDA reports for them (torch.cuda.mem_get_info / nvidia-smi, MiB):
# the figure vLLM multiplies by --gpu-memory-utilization. Marketing sizes are approximate
# ("80GB" H100 = 81,559 MiB = 85.5e9 bytes).
GPUS_MIB = {
    "a10g": 23_028,
    "l4": 23_034,
    "rtx4090": 24_564,
    "a100-40gb": 40_960,
    "l40s": 46_068,
    "a100-80gb": 81_920,
    "h100-80gb": 81_559,
    "h200": 143_771,
}
