"""The engine's swap space (kv/swap.py): whether this engine's KV can be swapped, and the copy
speed `preemption_mode='auto'` weighs, measured once at start-up.

Why the copy speed is measured and not assumed: it moves by orders of magnitude between a CPU
(copies inside one RAM) and a GPU (PCIe). The probe copies a scratch buffer of a few blocks to
host memory (no block of the pool is touched). The other side of the scale, the prefill speed,
is not probed: a start-up prefill cost 1.5 s of a 2.1 s start on the embedded model, and 64
tokens say little about the lengths that get preempted; the engine feeds the swap space its own
prefill steps instead (`SwapSpeeds.observe_prefill`).
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.swap import GIB, SwapSpace, SwapSpeeds
from kvserve.kv.tensors import KVTensorPool

logger = logging.getLogger("kvserve")
PROBE_BYTES = 8 * 1024**2


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


def build_swap_space(config: EngineConfig, kv: KVCacheManager, tensors: KVTensorPool
                     ) -> SwapSpace | None:
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
    if config.preemption_mode == "auto":
        # on config.device: where the copies run (a tensor-parallel core's own pool is a
        # `meta` view; its workers' pools are on that device)
        speeds = SwapSpeeds(measure_copy_speed(torch.device(config.device)))
        logger.info("swap preemption: copies at %.2f GB/s", speeds.copy_bytes_per_s / 1e9)
    return SwapSpace(config.preemption_mode, int(config.swap_space * GIB),
                     tensors.page_bytes * len(tensors.layers), config.block_size, speeds)


def measure_copy_speed(device: torch.device, repeats: int = 3) -> float:
    """Bytes per second of a device-to-host copy of a few blocks' worth, the best of `repeats`
    (the first one pays for the pages)."""
    src = torch.ones(PROBE_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return PROBE_BYTES / max(best, 1e-9)
