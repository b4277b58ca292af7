"""The engine's swap space (kv/swap.py): whether this engine's KV can be swapped, and the copy
and prefill speeds `preemption_mode='auto'` weighs, measured once at start-up.

Why measured and not assumed: the ratio decides every preemption, and it moves by orders of
magnitude between a CPU (copies inside one RAM, a slow prefill) and a GPU (PCIe copies, a
fast prefill). The probe is small (a few blocks copied out and back, a 64-token prefill twice,
on blocks that are free again right after) and runs only when `auto` could swap.
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.step import SeqStep
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.swap import GIB, SwapSpace, SwapSpeeds
from kvserve.kv.tensors import KVTensorPool

logger = logging.getLogger("kvserve")
PROBE_TOKENS = 64
PROBE_ID = "kvserve-swap-probe"


def unsupported_layout(kv: KVCacheManager, tensors: KVTensorPool) -> str | None:
    """Why this engine's KV cannot be swapped (None: it can). `preemption_mode='swap'` turns the
    per-group and windowed layouts off at build time and refuses int4 in the config, so only
    `auto` meets these."""
    if tensors.keeps_block_state:
        return "int4 KV keeps per-block state with the worker"
    if kv.num_groups > 1:
        return "per-group block tables (a hybrid layout)"
    if any(g.window is not None for g in kv.groups):
        return "blocks outside the sliding window are released"
    return None


def build_swap_space(config: EngineConfig, kv: KVCacheManager, tensors: KVTensorPool,
                     runner: ModelRunner) -> SwapSpace | None:
    """The swap space, or None when every preemption recomputes."""
    if config.preemption_mode == "recompute" or config.swap_space == 0:
        return None
    if config.bounded_kv_policy is not None:  # every request's blocks hold compacted KV
        return None
    reason = unsupported_layout(kv, tensors)
    if reason is not None:
        logger.info("preemption_mode='auto' recomputes: %s", reason)
        return None
    speeds = None
    if config.preemption_mode == "auto" and not config.calculate_kv_scales:
        # (a probe's K/V would set scales taken from the first K/V: then auto just swaps)
        speeds = measure_speeds(kv, tensors, runner)
        logger.info("swap preemption: copies at %.2f GB/s, prefill at %.0f tokens/s",
                    speeds.copy_bytes_per_s / 1e9, speeds.prefill_tokens_per_s)
    return SwapSpace(config.preemption_mode, int(config.swap_space * GIB),
                     tensors.page_bytes * len(tensors.layers), config.block_size, speeds)


@torch.inference_mode()
def measure_speeds(kv: KVCacheManager, tensors: KVTensorPool, runner: ModelRunner,
                   repeats: int = 3) -> SwapSpeeds:
    """Copy speed (blocks read out and written back, one way) and prefill speed, each the best of
    `repeats` (the first run of a prefill pays one-time set-up), on blocks taken from the fresh
    pool and given back."""
    bs = kv.block_size
    n = min(-(-PROBE_TOKENS // bs), kv.pool.num_free)
    blocks = kv.pool.allocate(n)
    try:
        copy = prefill = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = tensors.read_blocks(blocks)
            tensors.write_blocks(blocks, data)
            copy = min(copy, (time.perf_counter() - t0) / 2)
        tokens = min(PROBE_TOKENS, n * bs)
        ids = torch.randint(0, runner.model.config.vocab_size, (tokens,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        for _ in range(repeats):
            seq = SeqStep(PROBE_ID, ids, 0, 0, (blocks,), samples=False)
            t0 = time.perf_counter()
            runner.forward([seq])
            prefill = min(prefill, time.perf_counter() - t0)
    finally:
        kv.pool.release(blocks)
    nbytes = data.numel() * data.element_size()
    return SwapSpeeds(nbytes / max(copy, 1e-9), tokens / max(prefill, 1e-9))
