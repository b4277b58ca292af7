"""Engine configuration: one dataclass, vLLM's argument names, validated once at start-up.

Every other component receives the finished `EngineConfig` and trusts it, so all argument checks
live here and produce a `ValueError` that names the argument and the accepted range. Which
features do not combine is one table, kvserve/utils/features.py's `CONFLICTS`: `features()` names
what this config turns on and `check_features` refuses a listed pair (the builder and the input
processor add what only the model or a request says). The fields
also define the engine flags of `kvserve generate` / `serve` (see `kvserve.entrypoints.cli.add_engine_args`):
each field's metadata carries its help text and choices, so a flag cannot drift from its field.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.utils import features as F
from kvserve.utils.dtypes import DTYPE_ALIASES, DTYPES
from kvserve.kv.eviction import ONLINE_POLICIES, make_eviction_policy
from kvserve.kv.pins import check_pin_fractions
from kvserve.kv.spec import KV_CACHE_DTYPE_CHOICES, resolve_kv_dtype
from kvserve.kv.swap import PREEMPTION_MODES
from kvserve.utils.quant_formats import AT_LOAD, QUANTIZATIONS
from kvserve.blend.config import load_blend_config
from kvserve.spec.config import load_speculative_config

SUPPORTED_DTYPES = ("auto", *DTYPES)
DEVICES = ("cpu", "cuda", "auto")
SCHEDULING_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

# A CPU step's activations are float32 for every token it computes: an 8,192-token prompt in
# one step held ~300 MB of them beside its KV on the 1B Llama shape (~37 KB a token); in chunks
# of 2,048 the peak fell by 126 MB and the prefill ran no slower (docs/figures/startup-memory.md).
CPU_LONG_PREFILL_TOKENS = 2048
# On a CPU the "device memory" is the machine's RAM, shared with everything else; vLLM's CPU
# backend reserves a fixed KV space (4 GiB by default) instead of a fraction for the same reason.
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 1024**3


def _arg(default: Any, help: str, **flag: Any) -> Any:
    """A field whose help text (and argparse choices / metavar; positional=True for the one
    argument that is not a --flag) the CLI's engine arguments read from its metadata."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    """What an engine is built from. Field names follow vLLM's `EngineArgs`."""

    model: str | None = _arg(None, "a local Hugging Face checkpoint directory (default: the "
                             "embedded default model)", positional=True)
    tokenizer: str | None = _arg(None, "tokenizer directory (default: the model directory)")
    dtype: str = _arg("auto", "weights and activations; auto takes config.json's dtype",
                      choices=(*SUPPORTED_DTYPES, *DTYPE_ALIASES))
    seed: int = _arg(0, "seed of the engine's sampling generator")
    device: str = _arg("auto", "where the model and the KV cache live (auto = cuda when a GPU "
                       "is visible, else cpu; resolved here)", choices=DEVICES)
    block_size: int = _arg(16, "tokens per KV cache block")
    max_model_len: int | None = _arg(None, "longest sequence, prompt plus output (default: the "
                                     "model's max_position_embeddings)")
    max_num_seqs: int = _arg(256, "most requests in one batch")
    max_num_batched_tokens: int | None = _arg(None, "most tokens in one step (default: "
                                              "max(8192, max_model_len))")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over several steps")
    long_prefill_token_threshold: int | None = _arg(
        None, "most tokens of one prompt in one step, with chunked prefill (vLLM's name; "
        f"default: {CPU_LONG_PREFILL_TOKENS} on cpu, no limit on cuda; 0: no limit)")
    kv_cache_memory_bytes: int | None = _arg(None, "exact KV pool size in bytes; overrides "
                                             "--gpu-memory-utilization")
    gpu_memory_utilization: float = _arg(0.9, "fraction of device memory for the model and the "
                                         "KV pool (on CPU: of available RAM, capped)")
    num_threads: int | None = _arg(None, "torch intra-op threads on CPU (default: torch's "
                                   "choice; with tensor parallelism, per worker: the cores "
                                   "over the ranks)")
    tensor_parallel_size: int = _arg(1, "split the model over this many worker processes "
                                     "(ranks), each with its share of the heads, MLP columns, "
                                     "vocabulary and KV pool (torch.distributed: gloo on CPU, "
                                     "NCCL on CUDA); kvserve/parallel/", aliases=("-tp",))
    nnodes: int = _arg(1, "nodes the tensor-parallel ranks are spread over (evenly); node 0 "
                       "runs the engine core and the API, the others only their ranks")
    node_rank: int = _arg(0, "this node's index among --nnodes (0: the leader)")
    master_addr: str | None = _arg(None, "the leader's address for torch.distributed's "
                                   "env:// rendezvous (default: $MASTER_ADDR, else 127.0.0.1)")
    master_port: int | None = _arg(None, "its port (default: $MASTER_PORT, else 29500 across "
                                   "nodes, a free port on one)")
    kv_cache_dtype: str = _arg("auto", "KV cache storage: auto (the model's dtype), fp8 (= "
                               "fp8_e4m3, per-layer scales), fp8_e5m2, int8 (per token and head), "
                               "int4 (KIVI: keys per channel over a block)",
                               choices=KV_CACHE_DTYPE_CHOICES)
    calculate_kv_scales: bool = _arg(False, "fp8_e4m3 without k_scale/v_scale in the "
                                     "checkpoint: take each layer's scales from the first K/V "
                                     "it stores (else 1.0)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of shared prompt prefixes")
    eviction_policy: str = _arg("lru", "which idle cached blocks are evicted first",
                                choices=ONLINE_POLICIES)
    max_pinned_fraction: float = _arg(0.5, "most of the KV pool that one tenant's pinned "
                                      "prefixes (POST /v1/cache/pin) may hold; a tenant is an "
                                      "API key (kvserve/kv/pins.py)")
    max_pinned_total_fraction: float = _arg(0.5, "most of the KV pool that all tenants' "
                                            "pinned prefixes may hold together; at least "
                                            "--max-pinned-fraction (kvserve/kv/pins.py)")
    kv_tenant_quota: float | None = _arg(None, "bound each tenant's idle cached blocks to this "
                                         "fraction of the pool: a tenant over it evicts its own "
                                         "blocks first (tenants by cache_salt, or by API key "
                                         "with the server's --kv-tenant-by api_key); default "
                                         "off", metavar="FRACTION")
    kv_audit_rate: float = _arg(0.0, "fraction of prefix-cache hits recomputed off the hot "
                                "path and compared with the cached KV; a mismatch drops the "
                                "block (kvserve/engine/audit.py); default off", metavar="R")
    preemption_mode: str = _arg("auto", "how a request is preempted when the KV pool runs "
                                "out: recompute (free its blocks, compute its tokens again "
                                "later), swap (copy its KV to host swap space and back), auto "
                                "(per request, whichever the copy and prefill speeds measured "
                                "at start-up make faster); kvserve/kv/swap.py",
                                choices=PREEMPTION_MODES)
    swap_space: float = _arg(4.0, "GiB of host memory for the KV of swapped-out requests "
                             "(vLLM's name); a swap that does not fit recomputes", metavar="GIB")
    scheduling_policy: str = _arg("fcfs", "lpm: waiting requests with the longest cached "
                                  "prefix first", choices=SCHEDULING_POLICIES)
    attention_backend: str = _arg("auto", "auto: triton on cuda, torch on cpu",
                                  choices=ATTENTION_BACKENDS)
    deterministic: bool = _arg(
        False, "the same tokens and logprobs for a request whatever its batch, its prefill "
        "chunks, the prefix cache or speculative decoding did (SGLang's "
        "--enable-deterministic-inference): every attention row through the paged kernel's "
        "per-row arithmetic, quantized projections on the integer kernels at every row count; "
        "CPU, torch backend; costs some prefill speed (docs/deterministic.md); "
        "$KVSERVE_DETERMINISTIC=1 turns it on for every engine",
        aliases=("--enable-deterministic-inference",))
    enforce_eager: bool = _arg(False, "no CUDA graphs for decode batches (vLLM's name)")
    remeasure_kernels: bool = _arg(False, "CPU: time the GEMM kernels again instead of using "
                                   "the choice cached for this machine and model shape "
                                   "(kvserve/layers/gemm_select.py)")
    quantization: str | None = _arg(None, "gguf: a GGUF file's block-quantized projections "
                                    "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay in "
                                    "their block format (quantized kernels); none: "
                                    "every tensor dequantized at load; q8_0, q4_0, q4_1, q4_k: "
                                    "a float checkpoint's projections quantized at load into "
                                    "that GGUF block format (CPU, float32); default: gguf for "
                                    "a GGUF file on the CPU (vLLM's name; "
                                    "kvserve/layers/quantize_at_load.py)",
                                    choices=QUANTIZATIONS)
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "keep every KV block of a sliding-window layer for the request's life instead "
        "of releasing the blocks outside the window (vLLM's name)")
    bounded_kv_policy: str | None = _arg(None, "LOSSY: keep a bounded KV cache per request "
                                         "(full-attention models only): streaming_llm keeps "
                                         "the first sink tokens and the most recent ones; "
                                         "snapkv selects per head after the prompt; h2o keeps "
                                         "the most attended tokens and a recent half "
                                         "(kvserve/kv/bounded.py). Off by default")
    bounded_kv_budget: float | None = _arg(None, "tokens of KV a bounded request keeps: a whole "
                                           "number, or a fraction of max_model_len in (0, 1)")
    bounded_kv_sink_tokens: int = _arg(4, "attention-sink tokens a bounded cache always keeps")
    bounded_kv_observation_window: int = _arg(32, "snapkv: the prompt's last queries whose "
                                              "attention picks the kept tokens")
    structured_outputs_compile_timeout: float = _arg(
        10.0, "longest a structured-output grammar may take to compile, in seconds; a compile "
        "past it is stopped and its request refused (400), as is a compile whose every request "
        "left (kvserve/structured/compiler.py)", metavar="SECONDS")
    structured_outputs_max_schema_bytes: int = _arg(
        1 << 20, "largest structured-output grammar (a JSON schema as compact JSON, a regex, a "
        "grammar's text), in bytes; a larger one is refused (400) before it compiles",
        metavar="BYTES")
    structured_outputs_compile_workers: int = _arg(
        2, "grammar compile processes; each tenant (API key, or cache namespace) runs at most "
        "all but one of them, so another tenant's compile always finds one free",
        metavar="N")
    # None = no tiers; from Python also a dict or a TierConfig.
    kv_tier_config: Any = _arg(None, "storage tiers under the KV pool (host memory, disk, "
                               "Redis): a YAML file with LMCache's keys (chunk_size, local_cpu, "
                               "max_local_cpu_size, local_disk, max_local_disk_size, remote_url, "
                               "remote_serde, ...) or the same as a JSON string",
                               metavar="FILE_OR_JSON")
    # None = no disaggregation; from Python also a dict or a KVTransferConfig.
    kv_transfer_config: Any = _arg(None, "prefill/decode disaggregation (vLLM's flag): JSON "
                                   "with kv_connector (kvserve: pull over TCP; redis: a shared "
                                   "Redis tier), kv_role (kv_producer, kv_consumer, kv_both), "
                                   "kv_ip, kv_port, kv_buffer_size, kv_connector_extra_config "
                                   "(redis_url, chunk_size, transfer_timeout; a consumer's "
                                   "producers, the only ones it pulls from; auth_key_file); "
                                   "kvserve/kv/tiers/transfer.py", metavar="JSON")

    # None = no speculation; from Python also a dict or a SpeculativeConfig.
    speculative_config: Any = _arg(None, "speculative decoding drafted from the KV cache "
                                   "(vLLM's argument and JSON shape): {\"method\": \"ngram\", "
                                   "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
                                   "\"prompt_lookup_max\": 5}, method suffix (the prefix "
                                   "index) or method draft_model with \"model\": a draft "
                                   "checkpoint of the same tokenizer; kvserve/spec/",
                                   metavar="JSON")

    # None = no document reuse; from Python also a dict or a BlendConfig.
    blend_config: Any = _arg(None, "document reuse anywhere in the prompt (CacheBlend): "
                             "spans marked {\"cache_control\": {\"type\": \"document\"}} "
                             "reuse their stored KV, a share recomputed; JSON with "
                             "recompute_fraction (0.15), audit_rate, audit_threshold; "
                             "kvserve/blend/", metavar="JSON")

    def __post_init__(self) -> None:
        # vLLM's VLLM_BATCH_INVARIANT=1 in kvserve's name: on for every engine of the process
        if os.environ.get("KVSERVE_DETERMINISTIC", "0") not in ("", "0"):
            self.deterministic = True
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive_int("nnodes", self.nnodes)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a "
                             f"multiple of nnodes ({self.nnodes}): each node runs as many ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank}")
        _check_positive_int("structured_outputs_max_schema_bytes",
                            self.structured_outputs_max_schema_bytes)
        _check_positive_int("structured_outputs_compile_workers",
                            self.structured_outputs_compile_workers)
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not timeout > 0:
            raise ValueError("structured_outputs_compile_timeout must be a number of seconds "
                             f"> 0, got {timeout!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "num_threads"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                      or threshold < 0):
            raise ValueError("long_prefill_token_threshold must be a non-negative integer, "
                             f"got {threshold!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        make_eviction_policy(self.eviction_policy)  # the registry names the valid ones
        check_pin_fractions(self.max_pinned_fraction, self.max_pinned_total_fraction)
        if self.kv_tenant_quota is not None and not 0.0 < self.kv_tenant_quota <= 1.0:
            raise ValueError(f"kv_tenant_quota must be in (0, 1], got {self.kv_tenant_quota}")
        if not 0.0 <= self.kv_audit_rate <= 1.0:
            raise ValueError(f"kv_audit_rate must be in [0, 1], got {self.kv_audit_rate}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or not self.swap_space >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if not isinstance(self.kv_cache_dtype, str):
            raise TypeError(f"kv_cache_dtype must be a string, got {self.kv_cache_dtype!r}")
        resolve_kv_dtype(self.kv_cache_dtype)  # ValueError listing the valid names
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', "
                             f"got {self.scheduling_policy!r}")
        from kvserve.kv.tiers.config import load_tier_config

        self.kv_tier_config = load_tier_config(self.kv_tier_config)
        from kvserve.kv.tiers.transfer import load_transfer_config

        self.kv_transfer_config = load_transfer_config(self.kv_transfer_config)
        if self.kv_transfer_config is not None:  # a transfer runs through the tiers
            self.kv_tier_config = self.kv_transfer_config.tier_config(self.kv_tier_config,
                                                                      self.block_size)
        if self.kv_tier_config is not None and self.kv_tier_config.chunk_size % self.block_size:
            raise ValueError(f"kv_tier_config chunk_size ({self.kv_tier_config.chunk_size}) "
                             f"must be a multiple of block_size ({self.block_size})")
        self.speculative_config = load_speculative_config(self.speculative_config)
        self.blend_config = load_blend_config(self.blend_config)
        if (self.bounded_kv_policy is None) != (self.bounded_kv_budget is None):
            raise ValueError("bounded_kv_policy and bounded_kv_budget go together: a bounded "
                             "KV cache needs both a policy and a budget")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None), "
                             f"got {self.quantization!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.device == "auto" and self.quantization in AT_LOAD:
            self.device = "cpu"  # the quantized kernels are the CPU's
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton', "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        self.check_features()

    def features(self) -> set[str]:
        """The features (kvserve/utils/features.py) this config turns on by itself; the builder adds
        what the loaded model says, the input processor a request's bounded cache."""
        on = set()
        if self.kv_tier_config is not None:
            on.add(F.KV_TIERS)
        if not self.enable_prefix_caching:
            on.add(F.NO_PREFIX_CACHING)
        if self.calculate_kv_scales:
            on.add(F.CALCULATE_KV_SCALES)
        if self.device == "cuda":
            on.add(F.CUDA)
        if self.attention_backend == "torch":
            on.add(F.TORCH_BACKEND)
        elif self.attention_backend == "triton":
            on.add(F.TRITON_BACKEND)
        if resolve_kv_dtype(self.kv_cache_dtype) == "int4":
            on.add(F.INT4)
        if self.bounded_kv_policy is not None:
            on.add(F.BOUNDED)
        if self.preemption_mode == "swap":
            on.add(F.SWAP)
        if self.tensor_parallel_size > 1:
            on.add(F.TENSOR_PARALLEL)
        if self.quantization in AT_LOAD:
            on.add(F.QUANTIZE_AT_LOAD)
        if self.blend_config is not None:
            on.add(F.DOC_BLEND)
        if self.deterministic:
            on.add(F.DETERMINISTIC)
        if self.speculative_config is not None:
            on.add(F.SPEC_DECODE)
            if self.speculative_config.method == "suffix":
                on.add(F.SPEC_SUFFIX)
        return on

    def check_features(self, extra: set[str] = frozenset(), **context: Any) -> None:
        """Refuse a combination of this config's features (and `extra` ones, found later) that
        the compatibility table (kvserve/utils/features.py's CONFLICTS) lists."""
        F.check_features(self.features() | extra, **{
            "kv_cache_dtype": self.kv_cache_dtype, "backend": self.attention_backend,
            "method": getattr(self.speculative_config, "method", None), **context})

    def finalize(self, model_max_len: int) -> None:
        """Fill the limits that depend on the loaded model and check them against each other."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = CPU_LONG_PREFILL_TOKENS \
                if self.device == "cpu" else 0
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
