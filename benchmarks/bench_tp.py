#!/usr/bin/env python
"""What tensor parallelism adds per step (issue 32), on the CPU: the step message (a
--running-request decode StepInput encoded by kvserve/parallel/message.py, sent through the
shared buffer, decoded by a worker process, a reply back: median round trip) and the
all-reduces (a [batch, hidden] float32 all_reduce between two one-thread processes, gloo's and
kvserve/parallel/comm.py's shared-memory exchange, times the 61 a step of the reference model
runs). The decode speeds beside them are `kvserve bench latency` (docs/tensor_parallel.md).

    .venv/bin/python benchmarks/bench_tp.py [--running 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvserve.bench.record import current_machine


def _echo(conn, shm_name: str) -> None:
    from kvserve.parallel.channel import Receiver
    from kvserve.parallel.message import StepDecoder

    r, decoder = Receiver(conn, shm_name), StepDecoder()
    while True:
        msg = r.receive()
        if msg is None:
            break
        r.reply(("ok", len(decoder.decode(msg[1]).seqs)))


def message_overhead(running: int, blocks: int, repeats: int = 200) -> float:
    """Median seconds for one step message of `running` decodes (tables of `blocks` blocks;
    each step 1 in 16 of them grows a block, as with 16-token blocks) to be encoded, reach a
    worker process and be decoded there, and a reply to come back."""
    import torch.multiprocessing as mp

    from kvserve.worker.step import SeqStep, StepInput
    from kvserve.parallel.channel import Broadcast, read_reply
    from kvserve.parallel.message import StepEncoder

    ctx = mp.get_context("spawn")
    core, child = ctx.Pipe()
    channel = Broadcast([core])
    p = ctx.Process(target=_echo, args=(child, channel.name), daemon=True)
    p.start()
    tables = [list(range(i, i + blocks)) for i in range(running)]
    encoder = StepEncoder()
    times = []
    for k in range(repeats):
        for i in range(k % 16, running, 16):
            tables[i].append(running + blocks + k)
        step = StepInput(seqs=[SeqStep(str(i), [i % 500], 600 + i, 600 + i, (tables[i],), True)
                               for i in range(running)])
        t0 = time.perf_counter()
        channel.send(("step", encoder.encode(step)))
        read_reply(core)
        times.append(time.perf_counter() - t0)
    channel.send(None)
    p.join(5)
    channel.close()
    return statistics.median(times[10:])


def _reducer(rank: int, port: int, shm_name: str, rows: int, hidden: int, n: int,
             out) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.parallel.comm import Comm, ShmExchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(rows, hidden)
    times = []
    for comm in (Comm(rank, 2), Comm(rank, 2, ShmExchange(shm_name, rank, 2, x.numel() * 4))):
        for _ in range(20):
            comm.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            comm.all_reduce(x)
        times.append((time.perf_counter() - t0) / n)
        dist.barrier()
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def all_reduce_time(rows: int, hidden: int = 576, n: int = 300) -> list[float]:
    """Seconds per all_reduce of [rows, hidden] fp32 between two one-thread processes:
    [gloo, kvserve's shared-memory exchange]."""
    from multiprocessing import shared_memory

    import torch.multiprocessing as mp

    from kvserve.utils.ports import free_port
    from kvserve.parallel.comm import ShmExchange

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    shm = shared_memory.SharedMemory(create=True, size=ShmExchange.size(2, rows * hidden * 4))
    procs = [ctx.Process(target=_reducer, args=(r, port, shm.name, rows, hidden, n, out))
             for r in range(2)]
    for p in procs:
        p.start()
    t = out.get(timeout=120)
    for p in procs:
        p.join(30)
    shm.close()
    shm.unlink()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=256)
    args = ap.parse_args()
    print(current_machine())
    msg = message_overhead(args.running, 32)
    print(f"step message, {args.running} running decodes (32-block tables), round trip to a "
          f"worker: {msg * 1e3:.3f} ms (target <= 0.5 ms)")
    for batch in (64, 1):
        for name, t in zip(("gloo", "shared memory (kvserve)"), all_reduce_time(batch)):
            print(f"all_reduce [{batch}, 576] fp32, 2 ranks, {name}: {t * 1e6:.0f} us; x61 "
                  f"per step = {61 * t * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
