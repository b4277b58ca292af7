"""The engine core's side of tensor parallelism: one worker process per rank, every step sent
to all of them, rank 0's tokens back (vLLM v1's MultiprocExecutor draws the same line).

Faults: the core waits on every worker's pipe and process sentinel together, so a worker that
dies is noticed at once (not after a collective times out); one that raises while the others
wait in a collective for it is given `STUCK_GRACE_S` to be joined by the others, then every
worker is killed. Either way the executor is dead (`ExecutorDied`): the engine fails with a
clear error, the server answers 503, and no worker outlives it (each also exits when its pipe
to the core closes).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from kvserve.config import EngineConfig
from kvserve.utils.ports import free_port
from kvserve.worker.executor import ExecutorDied
from kvserve.worker.step import StepFailed, StepInput, StepOutput
from kvserve.parallel.channel import Broadcast, read_reply
from kvserve.parallel.comm import ShmExchange
from kvserve.parallel.message import StepEncoder
from kvserve.parallel.worker import WorkerInfo, worker_main

logger = logging.getLogger("kvserve")

START_TIMEOUT_S = 600  # loading a large shard
STUCK_GRACE_S = 10.0


def rendezvous(config: EngineConfig) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT: the config's, else the environment's, else this host and
    (one node) a free port or (several) 29500, torchrun's default."""
    addr = config.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = config.master_port or int(os.environ.get("MASTER_PORT", 0)) \
        or (29500 if config.nnodes > 1 else free_port())
    return addr, port


def _stop(procs: list, channel: Broadcast, exchange) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    channel.close()
    if exchange is not None:
        exchange.close()
        exchange.unlink()


class MultiprocExecutor:
    """Workers for ranks 0 .. tp-1 on this node (see the module docstring)."""

    def __init__(self, config: EngineConfig, tp: int, exchange_bytes: int = 0) -> None:
        """`exchange_bytes`: the slot of the shared-memory buffer the workers' collectives go
        through on the CPU (comm.ShmExchange; 0: torch.distributed's only)."""
        self.tp = tp
        self.local = local = tp // config.nnodes  # ranks on this node: 0 .. local - 1
        self.dead: str | None = None
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // local)
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(local)]
        self.conns = [core for core, _ in pipes]
        self.channel = Broadcast(self.conns)
        self.exchange = None
        if exchange_bytes and config.device == "cpu" and config.nnodes == 1:
            self.exchange = shared_memory.SharedMemory(
                create=True, size=ShmExchange.size(tp, exchange_bytes))
        exchange = (self.exchange.name, exchange_bytes) if self.exchange is not None else None
        master = rendezvous(config)
        self.procs = []
        for rank, (_, child) in enumerate(pipes):
            p = ctx.Process(target=worker_main, name=f"kvserve-tp{rank}", daemon=True,
                            args=(config, rank, tp, master, child, self.channel.name, threads,
                                  exchange, local))
            p.start()
            child.close()  # the worker's end lives in the worker: EOF here when it dies
            self.procs.append(p)
        self.infos: list[WorkerInfo] = []
        self.encoder = StepEncoder()
        # An engine nobody shut down (a script that just ends): its workers are killed and the
        # buffer unlinked when this executor is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.channel,
                                           self.exchange)

    # -- start-up ------------------------------------------------------------------------------
    def sized(self) -> list[int]:
        """Each rank's KV block count (after it loaded its shard)."""
        return [self._expect(r, "sized") for r in self._gather(START_TIMEOUT_S)]

    def allocate(self, num_blocks: int) -> list[WorkerInfo]:
        """Every rank allocates `num_blocks`; then each learns its part of a chunk."""
        self.channel.send(("allocate", num_blocks))
        self.infos = [self._expect(r, "ready") for r in self._gather(START_TIMEOUT_S)]
        # A chunk holds each distinct KV head range once (replicas share a part): the first
        # rank of each range is the one whose reads are kept.
        starts: dict[tuple[int, int], int] = {}
        self.reading_ranks = []
        for rank, info in enumerate(self.infos):
            if info.kv_heads not in starts:
                starts[info.kv_heads] = sum(self.infos[r].part_size for r in self.reading_ranks)
                self.reading_ranks.append(rank)
        self.channel.send(("parts", [(starts[i.kv_heads], starts[i.kv_heads] + i.part_size)
                                     for i in self.infos]))
        for reply in self._gather(START_TIMEOUT_S):
            self._expect(reply, "ok")
        return self.infos

    @property
    def rank_parts(self) -> tuple[int, ...]:
        """The parts of a chunk, in order (the tiers' key names this layout)."""
        return tuple(self.infos[r].part_size for r in self.reading_ranks)

    def _expect(self, reply: tuple, kind: str):
        if reply[0] != kind:
            self._die(f"a tensor-parallel worker failed to start: {reply[4]}")
        return reply[1]

    # -- steps ---------------------------------------------------------------------------------
    def execute(self, step: StepInput) -> StepOutput:
        replies = self._round(("step", self.encoder.encode(step)))
        errors = [r for r in replies if r[0] == "error"]
        if errors:
            _, stage, _, _, text, cause = errors[0]
            logger.error("tensor-parallel worker failed in its step:\n%s", text)
            if stage is None:
                raise cause
            whole = len(errors) == self.tp  # (else some rank's reads are missing)
            saved = list(self._joined([dict(r[2]) for r in replies]).items()) if whole else []
            swapped = self._joined([r[3] for r in replies]) if whole else {}
            raise StepFailed(stage, saved, swapped) from cause
        outs = [r[1] for r in replies]
        out = outs[0]
        out.saved = list(self._joined([dict(o.saved) for o in outs]).items())
        out.swapped = self._joined([o.swapped for o in outs])
        return out

    def compare_kv_blocks(self, pairs: list[tuple[int, int]]) -> list[tuple[float, float]]:
        replies = self._round(("compare", pairs))
        bad = [r for r in replies if r[0] == "error"]
        if bad:
            raise bad[0][5]
        per_rank = [r[1] for r in replies]
        return [tuple(max(d[i][j] for d in per_rank) for j in range(2))
                for i in range(len(pairs))]

    def _joined(self, per_rank: list[dict]) -> dict:
        """Each KV read (a chunk by hash, a swapped request by id) as the reading ranks' parts
        side by side; one a rank failed to read is left out (it is recomputed later)."""
        per_rank = [per_rank[r] for r in self.reading_ranks]
        axis = self.infos[0].axis
        return {key: parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
                for key in per_rank[0] if all(key in d for d in per_rank)
                for parts in [[d[key] for d in per_rank]]}

    def _round(self, message) -> list[tuple]:
        if self.dead is not None:
            raise ExecutorDied(self.dead)
        try:
            self.channel.send(message)
        except (BrokenPipeError, OSError):
            self._die(self._death_reason() or "a tensor-parallel worker's pipe closed")
        return self._gather(None)

    def _gather(self, timeout: float | None) -> list[tuple]:
        """One reply from every rank, in rank order; a death or a stuck rank kills them all."""
        replies: dict[int, tuple] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        stuck_since = None
        while len(replies) < self.tp:
            pending = [r for r in range(self.local) if r not in replies]
            waits = [self.conns[r] for r in pending] + [p.sentinel for p in self.procs]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if stuck_since is not None:
                left = max(0.0, stuck_since + STUCK_GRACE_S - time.monotonic())
            ready = wait(waits, left)
            for r in pending:
                if self.conns[r] in ready:
                    try:
                        reply = read_reply(self.conns[r])
                    except (EOFError, OSError):
                        self._die(self._death_reason() or f"tensor-parallel rank {r} closed "
                                                          "its pipe")
                    if reply[0] == "relayed":  # rank 0's, then the other nodes' ranks'
                        relayed = reply[1]
                        replies.update(zip(range(self.local, self.tp), relayed[1:]))
                        reply = relayed[0]
                    replies[r] = reply
                    if any(x[0] == "error" for x in replies.values()) and stuck_since is None:
                        stuck_since = time.monotonic()
            reason = self._death_reason()
            if reason is not None and len(replies) < self.tp:
                self._die(reason)
            if not ready:
                if stuck_since is not None:
                    text = next(r[4] for r in replies.values() if r[0] == "error")
                    self._die("a tensor-parallel worker raised while the others waited for it "
                              f"in a collective:\n{text}")
                self._die(f"tensor-parallel workers did not answer in {timeout:.0f} s")
        return [replies[r] for r in range(self.tp)]

    def _death_reason(self) -> str | None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) died " \
                       f"(exit code {p.exitcode})"
        return None

    def _die(self, reason: str):
        self.dead = reason
        logger.error("%s; stopping every worker", reason)
        self._kill()
        raise ExecutorDied(reason)

    def _kill(self) -> None:
        self._finalizer()

    def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "the executor was shut down"
            try:
                self.channel.send(("stop", None))
            except OSError:
                pass
            for p in self.procs:
                p.join(10)
        self._kill()
        for conn in self.conns:
            conn.close()
