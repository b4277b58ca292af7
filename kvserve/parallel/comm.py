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


def init(rank: int, world_size: int, device: str, local_ranks: int):
    """Join the process group (MASTER_ADDR / MASTER_PORT from the environment); returns the
    relay group of rank 0 and the ranks on other nodes (ranks `local_ranks` on: the engine
    core's node runs ranks 0 .. local_ranks - 1), or None when every rank is local. Every rank
    makes the group, as torch.distributed requires."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % local_ranks)  # this node's GPUs, one per local rank
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if local_ranks == world_size:
        return None
    return dist.new_group([0, *range(local_ranks, world_size)], backend="gloo",
                          timeout=datetime.timedelta(days=365))


class Comm:
    """The forward's collectives for one process group of `world_size` ranks: through a
    shared-memory buffer where every rank is on this node (`ShmExchange`), else (or for a
    tensor too large for it) torch.distributed's."""

    def __init__(self, rank: int, world_size: int, shm: ShmExchange | None = None) -> None:
        self.rank, self.world_size, self.shm = rank, world_size, shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel projection's partial products); the
        same bits on every rank (the parts are added in rank order everywhere)."""
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.exchange(x)
            torch.add(parts[0], parts[1], out=x)
            for part in parts[2:]:
                x.add_(part)
            return x
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's x [N, sizes[r]] side by side, [N, sum(sizes)] (the vocabulary-parallel
        LM head's logits); parts of unequal width are padded to the widest for the gather."""
        width = max(sizes)
        if x.shape[1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.exchange(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


class ShmExchange:
    """Every rank's tensor, through one shared-memory buffer, for ranks on one node.

    Why not gloo: its all_reduce of a [1, 576] tensor between two local processes took 1.4 ms
    here (TCP over loopback), 86 ms of a 61-reduction decode step; this takes microseconds.
    Each rank copies its tensor into its slot and then publishes the call's sequence number in
    its own cache line; it reads the others' slots once their numbers reach it. Two buffers
    alternate by sequence number, so a rank that runs ahead into the next call writes the
    other buffer; it cannot run two ahead, since that needs every rank's next number, which a
    rank posts only after it has read this call's slots. (x86 keeps stores in order, so a
    number seen means the slot it follows is written.) The parts returned are views of the
    buffer: use them before the next call."""

    SPIN = 2000  # reads of a flag before yielding the core between reads

    def __init__(self, name: str, rank: int, world_size: int, slot_bytes: int) -> None:
        import mmap

        import numpy as np

        # mapped directly (not as a SharedMemory, whose close at exit raises while the tensor
        # views below hold the buffer); the engine core created and unlinks it
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            self.buf = mmap.mmap(fd, self.size(world_size, slot_bytes))
        finally:
            os.close(fd)
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.flags = np.frombuffer(self.buf, dtype=np.int64, count=8 * world_size)[::8]
        self.data = torch.frombuffer(self.buf, dtype=torch.uint8,
                                     offset=64 * world_size,
                                     count=2 * world_size * slot_bytes
                                     ).view(2, world_size, slot_bytes)
        self.seq = 0

    @staticmethod
    def size(world_size: int, slot_bytes: int) -> int:
        return 64 * world_size + 2 * world_size * slot_bytes

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.seq += 1
        seq, flags = self.seq, self.flags
        n = x.numel() * x.element_size()
        slots = self.data[seq % 2, :, :n]
        slots[self.rank].view(x.dtype).view(x.shape).copy_(x)
        flags[self.rank] = seq
        for r in range(self.world_size):
            if r == self.rank:
                continue
            spins = 0
            while flags[r] < seq:
                spins += 1
                if spins > self.SPIN:
                    self._wait_slowly(r, seq)
                    break
        return [slots[r].view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def _wait_slowly(self, r: int, seq: int) -> None:
        """A peer that is late (descheduled, or still computing a long prefill): yield the
        core between reads; fail after the collective timeout (a peer that died: the engine
        core has noticed by then and stops this process anyway)."""
        import time

        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while self.flags[r] < seq:
            os.sched_yield()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {r} did not reach a collective in "
                                   f"{COLLECTIVE_TIMEOUT_S} s")



def exchange_slot_bytes(config, model_config, tp: int) -> int:
    """A slot that holds the largest tensor a step exchanges in float32: a full batch of
    hidden states, or the sampled rows' share of the logits (larger prompt-logprob gathers
    go through torch.distributed)."""
    hidden = config.max_num_batched_tokens * model_config.hidden_size
    logits = config.max_num_seqs * -(-model_config.vocab_size // tp)
    return 4 * max(hidden, logits)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
