"""Size the GPU KV pool: what is left of `gpu_memory_utilization` after weights and activations.

Like vLLM's profile run: one forward over the largest batch a step can hold
(`max_num_batched_tokens` new tokens) plus the LM head for `max_num_seqs` rows, measuring the
allocator's peak. Attention is stood in for by allocating its output only: the Triton kernels
need no workspace beyond it (decode's split buffers are a few MB), so the measured peak is what
a real step reaches, without needing a KV pool to exist yet.
"""

from __future__ import annotations

import logging
import os

import torch

from kvserve.config import EngineConfig
from kvserve.models.decoder import CausalLM

logger = logging.getLogger("kvserve")

# Kept free for CUDA graphs' pool, cuBLAS workspaces and the sampler, which the profile run does
# not see.
GPU_RESERVE_BYTES = 512 * 1024**2


@torch.inference_mode()
def profile_peak_memory(model: CausalLM, num_tokens: int, num_logit_rows: int,
                        max_model_len: int) -> int:
    """Peak bytes allocated (weights included) by one forward over `num_tokens` tokens."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % max_model_len

    def attn(layer_idx: int, q: torch.Tensor, *rest) -> torch.Tensor:
        # MLA's function takes (q_nope, q_rope, latent, projections) and returns v_head wide
        width = rest[-1].w_uv.shape[1] if len(rest) == 3 else q.shape[-1]
        return torch.zeros(q.shape[:-1] + (width,), dtype=q.dtype, device=q.device)

    hidden = model(ids, positions, attn)
    logits = model.compute_logits(hidden[: min(num_tokens, num_logit_rows)])
    del hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak


def profile_kv_budget(model: CausalLM, cfg: EngineConfig) -> int:
    """Bytes the KV pool may take: total x gpu_memory_utilization - peak - other processes'
    and the CUDA context's use - a fixed reserve. Raises ValueError when nothing is left."""
    assert cfg.max_num_batched_tokens is not None and cfg.max_model_len is not None
    device = model.device
    peak = profile_peak_memory(model, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                               cfg.max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(total * cfg.gpu_memory_utilization) - peak - non_torch - GPU_RESERVE_BYTES
    logger.info("GPU memory: %.2f GiB total, peak %.2f GiB (weights + activations), "
                "%.2f GiB outside torch; %.2f GiB for the KV pool", total / 2**30,
                peak / 2**30, non_torch / 2**30, max(budget, 0) / 2**30)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x "
                         f"gpu_memory_utilization={cfg.gpu_memory_utilization} is less than the "
                         f"{peak / 2**30:.1f} GiB of weights and activations; raise "
                         "gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be had without swapping), else total RAM: on a
    CPU this is the "device" memory the KV pool is a fraction of."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
