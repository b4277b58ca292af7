"""The collectives a sharded forward runs, over torch.distributed's default process group
(gloo on the CPU, NCCL on CUDA), joined by the `env://` rendezvous so that the same code runs
across nodes with MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE set by a launcher."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A collective that waits this long for a peer fails rather than hangs (a peer that died is
# noticed by the engine core sooner, through its process sentinel).
COLLECTIVE_TIMEOUT_S = 60


def init(rank: int, world_size: int, device: str) -> None:
    """Join the process group (MASTER_ADDR / MASTER_PORT from the environment)."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


class Comm:
    """The forward's collectives for one process group of `world_size` ranks."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel projection's partial products)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's x [N, sizes[r]] side by side, [N, sum(sizes)] (the vocabulary-parallel
        LM head's logits); parts of unequal width are padded to the widest for the gather."""
        width = max(sizes)
        if x.shape[1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
