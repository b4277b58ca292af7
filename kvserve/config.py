"""Engine configuration: one dataclass, vLLM's argument names, validated once at start-up.

Every other component receives the finished `EngineConfig` and trusts it, so all argument checks
live here and produce a `ValueError` that names the argument and the accepted range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.dtypes import DTYPE_ALIASES, DTYPES

SUPPORTED_DTYPES = ("auto", *DTYPES)

# On a CPU the "device memory" is the machine's RAM, shared with everything else; vLLM's CPU
# backend reserves a fixed KV space (4 GiB by default) instead of a fraction for the same reason.
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 1024**3


@dataclass
class EngineConfig:
    """What an engine is built from. Field names follow vLLM's `EngineArgs`."""

    model: str | None = None  # a local Hugging Face checkpoint directory; None = embedded default
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # weights and activations; "auto" takes config.json's torch_dtype
    seed: int = 0
    device: str = "auto"  # "auto" = cuda when torch sees a GPU, else cpu (resolved here)
    block_size: int = 16
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = max(8192, max_model_len)
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None  # exact KV pool size; overrides the fraction below
    gpu_memory_utilization: float = 0.9  # on CPU: fraction of available RAM, capped (see above)
    num_threads: int | None = None  # torch intra-op threads on CPU; None = leave torch's choice
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"  # which idle cached blocks go first: lru, lfu or priority
    scheduling_policy: str = "fcfs"  # "lpm": waiting requests with the longest cached prefix first
    attention_backend: str = "auto"  # "torch" | "triton"; auto = triton on cuda, torch on cpu
    enforce_eager: bool = False  # vLLM's name: True = no CUDA graphs for decode batches
    # Storage tiers under the KV pool (host memory, disk, Redis): a YAML file with LMCache's key
    # names, a JSON string, a dict or a TierConfig; None = no tiers.
    kv_tier_config: Any = None

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "num_threads"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.eviction_policy not in ("lru", "lfu", "priority"):
            raise ValueError("eviction_policy must be 'lru', 'lfu' or 'priority', "
                             f"got {self.eviction_policy!r}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', "
                             f"got {self.scheduling_policy!r}")
        from kvserve.kv.tiers.config import load_tier_config

        self.kv_tier_config = load_tier_config(self.kv_tier_config)
        if self.kv_tier_config is not None:
            if not self.enable_prefix_caching:
                raise ValueError("kv_tier_config needs prefix caching (enable_prefix_caching)")
            if self.kv_tier_config.chunk_size % self.block_size:
                raise ValueError(f"kv_tier_config chunk_size ({self.kv_tier_config.chunk_size}) "
                                 f"must be a multiple of block_size ({self.block_size})")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton', "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        if self.device == "cuda" and self.attention_backend == "torch":
            raise ValueError("attention_backend='torch' is the CPU backend; use 'triton' (or "
                             "'auto') with device='cuda'")

    def finalize(self, model_max_len: int) -> None:
        """Fill the limits that depend on the loaded model and check them against each other."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from `LLM(**kwargs)`, naming any argument this engine does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
