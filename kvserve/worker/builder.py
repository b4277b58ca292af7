"""What an engine is made of, built from its config: the model, the KV pool and its manager,
the storage tiers, the worker and its executor.

Why apart from LLMEngine: sizing the KV pool (the memory budget on the CPU, a profile on the
GPU), choosing the layout (one block table, per-group tables for hybrid models, a released
window), the fp8 scales, the tiers' chunk identity and the CUDA graphs are decided once, at
start-up, and read nothing of the step loop; the engine keeps the parts (`EngineParts`) and
runs steps over them. Under tensor parallelism kvserve/parallel/build.py builds the core's
half here and each worker process (kvserve/parallel/worker.py) its model and KV pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.utils import features as F
from kvserve.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from kvserve.worker.executor import InProcessExecutor
from kvserve.worker.model_build import load_model
from kvserve.worker.gpu_memory import available_host_memory
from kvserve.worker.model_runner import ModelRunner
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import (
    KV_DTYPES,
    KVCacheSpec,
    KVGroup,
    KVStorage,
    capacity_line,
    decoder_kv_spec,
    kv_dtype_name,
    mla_saving_line,
    resolve_kv_dtype,
)
from kvserve.kv.tensors import KVTensorPool
from kvserve.kv.tiers.link import TierLink
from kvserve.attention.base import AttentionBackend
from kvserve.attention.select import make_attention_backend
from kvserve.models.config import ModelConfig
from kvserve.models.decoder import CausalLM
from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve")

# KV events (kv/events.py) kept between drains: the server drains after every step, so this only
# bounds an engine nobody drains (the offline LLM), at a few MB.
KV_EVENTS_CAPACITY = 65_536


@dataclass
class EngineParts:
    model: CausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    kv_spec: KVCacheSpec
    page_groups: tuple[KVGroup, ...] | None
    tensors: KVTensorPool
    backend: AttentionBackend
    tiers: object | None  # kvserve.kv.tiers.tiered.TieredKVStore
    kv: KVCacheManager
    runner: ModelRunner
    executor: InProcessExecutor
    drafter: Any = None  # speculative_config method draft_model: its DraftModelDrafter


def resolve_model_dir(config: EngineConfig) -> str:
    """config.model, the embedded default's path when it is None (written back)."""
    if config.model is None:
        from kvserve.model_loader.default import embedded_model_path

        config.model = str(embedded_model_path())
    return config.model


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The model's config.json (a GGUF file's metadata), without loading any weight."""
    from kvserve.model_loader.gguf_checkpoint import is_gguf, open_gguf
    from kvserve.models import registry

    model_dir = resolve_model_dir(config)
    return registry.config_from_dir(open_gguf(model_dir).dir if is_gguf(model_dir)
                                    else model_dir)


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the model (the embedded default when config.model is None), finalize the config
    against it, and size and build everything a step runs over (in this process: with
    tensor_parallel_size > 1 kvserve/parallel/build.py builds the parts instead)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config)
    # (the Triton backend on a GPU: fused element-wise kernels, fewer launches per step)
    model, model_config = load_model(model_dir, config.dtype, config.device,
                                     remeasure_kernels=config.remeasure_kernels,
                                     quantization=config.quantization,
                                     elementwise="triton" if config.attention_backend
                                     == "triton" else "torch",
                                     deterministic=config.deterministic)
    tokenizer = Tokenizer.from_dir(config.tokenizer or tokenizer_dir(model_dir))
    config.finalize(model_config.max_position_embeddings)
    model.limit_positions(config.max_model_len)
    dtype = next(model.parameters()).dtype
    check_model_features(config, model_config, dtype)  # before any memory is sized
    kv_spec = engine_kv_spec(model_config, dtype, config.block_size, config.kv_cache_dtype)
    groups = page_groups_of(config, kv_spec)
    num_blocks = num_kv_blocks(config, kv_spec, groups, model)
    tensors = KVTensorPool(kv_spec, num_blocks, config.device,
                           *kv_scales(config, kv_spec, model_config, model_dir),
                           page_groups=groups)
    backend = make_attention_backend(config.attention_backend, tensors,
                                     model_config.attention_scale, dtype,
                                     model_config.attn_logit_softcapping,
                                     config.deterministic)
    tiers, kv = make_kv_manager(config, kv_spec, model_config, tensors, groups, num_blocks)
    runner = ModelRunner(model, backend, tensors, config.block_size, config.seed)
    capture_graphs(config, runner, model, backend, tensors, groups, model_config)
    _log_capacity(config, kv, model_config, kv_spec, model, groups)
    drafter = load_drafter(config, model_config, tokenizer)
    return EngineParts(model, model_config, tokenizer, dtype, kv_spec, groups, tensors, backend,
                       tiers, kv, runner, InProcessExecutor(runner), drafter)


def load_drafter(config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer
                 ) -> Any:
    """speculative_config method draft_model: the draft model, loaded as the target is
    (`load_model`: a directory or a GGUF file, its quantization), checked against the target
    (the same tokenizer, an attention the drafter computes) and logged as the target's
    start-up lines are (load time, weight bytes, draft KV per token); None otherwise."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    import time

    from kvserve.model_loader.weight_bytes import weight_bytes
    from kvserve.spec.draft_model import DraftModelDrafter, check_same_vocabulary

    started = time.perf_counter()
    model, draft_config = load_model(spec.model, config.dtype, config.device,
                                     quantization=spec.quantization)
    seconds = time.perf_counter() - started
    check_same_vocabulary(draft_config, model_config, _vocabulary(spec.model),
                          tokenizer.backend.get_vocab(with_added_tokens=True))
    max_len = min(spec.max_model_len or draft_config.max_position_embeddings,
                  draft_config.max_position_embeddings, config.max_model_len)
    model.limit_positions(max_len)
    drafter = DraftModelDrafter(model, draft_config, max_len)
    per_token = 2 * draft_config.num_hidden_layers * draft_config.kv_size * \
        drafter.dtype.itemsize
    logger.info("draft model %s (%s, %d layers): loaded in %.2f s; %s; draft KV %.1f KB per "
                "token of each running request, up to %d tokens", spec.model,
                draft_config.architecture, draft_config.num_hidden_layers, seconds,
                weight_bytes(model).line(), per_token / 1e3, max_len)
    return drafter


def _vocabulary(model: str) -> dict[str, int] | None:
    """A checkpoint's token -> id map, None where it carries no tokenizer."""
    try:
        return Tokenizer.from_dir(tokenizer_dir(model)).backend.get_vocab(with_added_tokens=True)
    except ValueError:
        return None


def make_kv_manager(config: EngineConfig, kv_spec: KVCacheSpec, model_config: ModelConfig,
                    tensors: KVTensorPool, groups: tuple[KVGroup, ...] | None, num_blocks: int,
                    rank_parts: tuple[int, ...] = ()) -> tuple[object | None, KVCacheManager]:
    """The storage tiers (if configured) and the KV manager over `num_blocks` blocks;
    `rank_parts`: each tensor-parallel rank's part of a chunk (its key says so)."""
    tiers = _make_tiers(config, kv_spec, model_config, tensors, config.model, rank_parts)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                        config.eviction_policy,
                        TierLink(tiers, config.block_size) if tiers else None,
                        kv_events_capacity=KV_EVENTS_CAPACITY,
                        window=_release_window(config, kv_spec, groups, tiers),
                        group_windows=None if groups is None
                        else [getattr(g.spec, "window", None) for g in groups],
                        track_released=tensors.keeps_block_state,
                        max_pinned_fraction=config.max_pinned_fraction,
                        max_pinned_total_fraction=config.max_pinned_total_fraction,
                        tenant_quota=config.kv_tenant_quota)
    return tiers, kv


def _kv_dtype_features(model_config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str
                       ) -> tuple[set[str], dict[str, Any]]:
    """`features.model_features` for a model computing in `dtype` whose KV cache is
    `kv_cache_dtype`."""
    model_kv = kv_dtype_name(dtype)
    name = resolve_kv_dtype(kv_cache_dtype, model_kv)
    return F.model_features(model_config, name != model_kv, model_kv=model_kv,
                          kv_cache_dtype=kv_cache_dtype,
                          what="a quantized" if KV_DTYPES[name].quantized else "another")


def check_model_features(config: EngineConfig, model_config: ModelConfig,
                          dtype: torch.dtype) -> None:
    """Refuse what the config asks for that the loaded model cannot do (the compatibility
    table's rows that name a model feature)."""
    on, context = _kv_dtype_features(model_config, dtype, config.kv_cache_dtype)
    config.check_features(on, **context)


def capture_graphs(config: EngineConfig, runner: ModelRunner, model: CausalLM,
                    backend: AttentionBackend, tensors: KVTensorPool,
                    groups: tuple[KVGroup, ...] | None, model_config: ModelConfig) -> None:
    """CUDA graphs for decode batches, where the layout allows them."""
    if config.device != "cuda" or config.enforce_eager:
        return
    if tensors.quantized:
        logger.info("quantized KV cache: decode steps run eagerly (no CUDA graphs)")
    elif groups is not None:
        logger.info("per-group KV block tables: decode steps run eagerly (no CUDA graphs)")
    elif model_config.mla is None:
        from kvserve.worker.cuda_graphs import CUDAGraphRunner

        runner.graphs = CUDAGraphRunner(model, backend, config.max_num_seqs,
                                        config.max_model_len)
        runner.graphs.capture_all()


def page_groups_of(config: EngineConfig, kv_spec: KVCacheSpec) -> tuple[KVGroup, ...] | None:
    """The hybrid layout (kv/spec.py's `page_groups`: one block table per group of equal
    size, windowed groups releasing what falls out of their window), unless disabled or
    storage tiers or swap preemption are on (their chunks hold every layer of a block); None
    keeps one table for every layer. (Bounded caches refuse windowed layers, so never meet this
    layout.)"""
    groups = kv_spec.page_groups()
    if groups is None or config.disable_hybrid_kv_cache_manager:
        return None
    tiers = config.kv_tier_config
    if tiers is not None and tiers.enabled or config.preemption_mode == "swap":
        logger.warning("%s: a hybrid model keeps every block of every layer",
                       "preemption_mode='swap'" if config.preemption_mode == "swap"
                       else "storage tiers are on")
        return None
    logger.info("hybrid KV cache: %d groups of %d layers, one block table each",
                len(groups), len(groups[0].layers))
    return groups


def _release_window(config: EngineConfig, kv_spec: KVCacheSpec,
                    groups: tuple[KVGroup, ...] | None, tiers: object | None) -> int | None:
    """The window outside which the manager releases blocks: a model whose every layer is
    windowed, unless disabled or storage tiers or swap preemption are on (their chunks hold
    whole blocks)."""
    window = kv_spec.release_window
    if window is None or config.disable_hybrid_kv_cache_manager or groups is not None:
        return None
    if tiers is not None or config.preemption_mode == "swap":
        logger.warning("%s: blocks outside the sliding window are kept",
                       "storage tiers are on" if tiers is not None
                       else "preemption_mode='swap'")
        return None
    return window


def num_kv_blocks(config: EngineConfig, kv_spec: KVCacheSpec,
                   groups: tuple[KVGroup, ...] | None, model: CausalLM) -> int:
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif config.device == "cuda":
        from kvserve.worker.gpu_memory import profile_kv_budget

        budget = profile_kv_budget(model, config)
    else:
        # No point reserving more than every sequence slot at full length could use.
        most = config.max_num_seqs * config.max_model_len * kv_spec.bytes_per_token
        budget = min(int(available_host_memory() * config.gpu_memory_utilization),
                     CPU_DEFAULT_KV_CACHE_BYTES, most)
    page = kv_spec.page_bytes(groups)
    blocks = budget // page
    if blocks < 1:
        raise ValueError(f"KV cache memory of {budget:,} bytes holds no block of "
                         f"{page:,} bytes; raise kv_cache_memory_bytes")
    return blocks


def kv_scales(config: EngineConfig, kv_spec: KVCacheSpec, model_config: ModelConfig,
               model_dir: str) -> tuple[torch.Tensor | None, bool]:
    """fp8_e4m3's per-layer scales: the checkpoint's k_scale/v_scale, else computed from the
    first batch (calculate_kv_scales), else 1.0 with a warning. e5m2 takes none (as vLLM)."""
    storage = kv_spec.layer_specs()[0].storage
    if storage.dtype != "fp8":
        return None, False
    from kvserve.model_loader.loader import read_kv_scales

    scales = read_kv_scales(model_dir, model_config.num_hidden_layers)
    if scales is not None:
        logger.info("fp8 KV cache: k_scale/v_scale of every layer from the checkpoint")
    elif config.calculate_kv_scales:
        logger.info("fp8 KV cache: scales computed from the first batch "
                    "(calculate_kv_scales)")
    else:
        logger.warning("fp8_e4m3 KV cache without k_scale/v_scale in the checkpoint: "
                       "using 1.0 (set calculate_kv_scales=True to compute them); "
                       "accuracy may suffer")
    return scales, config.calculate_kv_scales


def _make_tiers(config: EngineConfig, kv_spec: KVCacheSpec, model_config: ModelConfig,
                tensors: KVTensorPool, model_dir: str, rank_parts: tuple[int, ...] = ()):
    """Storage tiers under the pool, if configured; keys name this model, dtype and layout."""
    tier_config = config.kv_tier_config
    if tier_config is None or not tier_config.enabled:
        return None
    from kvserve.kv.tiers.chunk import ChunkIdentity, model_fingerprint
    from kvserve.kv.tiers.tiered import TieredKVStore

    # What each layer stores per token, from the pool's spec: (K, V) of [Hkv, D] or MLA's one
    # latent vector.
    layer_tensors = kv_spec.layer_specs()[0].tensors
    heads, width = layer_tensors[0]
    identity = ChunkIdentity(tier_config.model_name or model_fingerprint(model_dir),
                             tensors.dtype, model_config.num_hidden_layers, heads, width,
                             config.block_size, tier_config.chunk_size, len(layer_tensors),
                             kv_format=tensors.format_tag(),
                             page_bytes=tensors.page_bytes if tensors.packed else None,
                             rank_parts=rank_parts)
    tiers = TieredKVStore(tier_config, identity)
    logger.info("KV storage tiers: %s", ", ".join(
        [f"host {tier_config.max_local_cpu_size:g} GB"] * tier_config.local_cpu
        + [f"disk {tier_config.local_disk} {tier_config.max_local_disk_size:g} GB"]
        * (tier_config.local_disk is not None)
        + [f"remote {tier_config.remote_url}"] * (tier_config.remote_url is not None)))
    return tiers


def engine_kv_spec(model_config, dtype: torch.dtype, block_size: int,
                   kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """What the engine stores per token: K and V of every layer in `kv_cache_dtype` ("auto":
    the model's dtype; int4 keys grouped by block), with each sliding layer's window, or MLA's
    latent vector (the attention backends read the windows from this spec; the planner derives
    its figures from the same spec classes)."""
    mc = model_config
    mla = mc.mla
    name = resolve_kv_dtype(kv_cache_dtype, kv_dtype_name(dtype))
    # MLA's latent is stored as the model computes it, never quantized: refused here too, for
    # a caller other than build_engine (kv/quant.py's make_codec refuses quantized latents).
    on, context = _kv_dtype_features(mc, dtype, kv_cache_dtype)
    F.check_features(on, **context)
    storage = KVStorage(name, key_group_tokens=block_size if name == "int4" else None)
    return decoder_kv_spec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, storage,
                           block_size, mc.layer_windows,
                           kv_lora_rank=mla.kv_lora_rank if mla else None,
                           rope_dim=mla.qk_rope_head_dim if mla else 0)


def _log_capacity(config: EngineConfig, kv: KVCacheManager, model_config: ModelConfig,
                  kv_spec: KVCacheSpec, model: CausalLM,
                  groups: tuple[KVGroup, ...] | None) -> None:
    """The start-up lines users size deployments by: the weight bytes the model holds
    (quantized blocks and float tensors: `weight_bytes`, the count `kvserve plan
    --quantization` predicts), the KV pool's bytes, tokens and requests, and what MLA's
    latent cache saves."""
    from kvserve.model_loader.weight_bytes import weight_bytes

    logger.info("%s; KV pool %.1f MB", weight_bytes(model).line(),
                kv.num_blocks * kv_spec.page_bytes(groups) / 1e6)
    logger.info(capacity_line(kv.num_blocks, config.block_size, config.max_model_len,
                              kv.final_blocks(config.max_model_len), kv.num_groups))
    mla = model_config.mla
    if mla is not None:
        logger.info(mla_saving_line(kv_spec.layer_specs()[0], model_config.num_attention_heads,
                                    mla.qk_head_dim, mla.v_head_dim))
