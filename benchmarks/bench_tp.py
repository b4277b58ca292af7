#!/usr/bin/env python
"""Tensor parallelism (issue 32): tp=2 x 1 thread against tp=1 x 2 threads, side by side in
one run, at batch 64 and batch 1 decode on the reference model (the embedded SmolLM2-135M:
3 KV heads over 2 ranks are 2 + 1), with what TP adds per step.

Both engines run float32 dense weights (`--quantization none`): tensor parallelism
dequantizes a GGUF file, so tp=1 runs the same bytes per weight; tp=1 with its quantized
kernels (the default for the GGUF file) is printed too. On 2 shared cores no speed-up is
expected: two ranks of one thread have the same cores as one process of two threads, and pay
the all-reduces and the step message on top. What TP adds is measured apart:

* the step message: a 256-request decode StepInput encoded (kvserve/parallel/message.py:
  columns, block tables only where they changed), written to the shared buffer, woken, read
  and decoded by a worker process, and a reply back (median round trip, `--running`);
* the all-reduces: an all_reduce of a [batch, hidden] float32 tensor between two processes of
  one thread, gloo's and the shared-memory exchange the workers use (kvserve/parallel/comm.py),
  times the 61 a step of this model runs (one per layer's o and down, one for the embedding).

    .venv/bin/python benchmarks/bench_tp.py
    .venv/bin/python benchmarks/bench_tp.py --steps 64 --repeats 3
    .venv/bin/python benchmarks/bench_tp.py --device cuda   # two GPUs: NCCL, graphs per rank
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swap import cpu_line  # noqa: E402


def decode_speed(tp: int, threads: int, batch: int, steps: int, quantization: str | None,
                 prompt: int = 64, device: str = "cpu") -> float:
    """Decode tokens per second over `steps` steps of `batch` running requests (timed after
    every request has its first token)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(dtype="float32", tensor_parallel_size=tp, num_threads=threads, device=device,
              quantization=quantization, max_model_len=prompt + steps + 16,
              max_num_seqs=max(batch, 1), kv_cache_memory_bytes=256 << 20)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, 40000)
                                                 for _ in range(prompt)]}, params)
    while any(not r.output_token_ids for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    return batch * steps / elapsed


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

    from kvserve.parallel.comm import ShmExchange
    from kvserve.parallel.executor import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
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
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: tp=2 over two GPUs (NCCL, CUDA graphs per rank) against tp=1")
    args = ap.parse_args()
    print(cpu_line())
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(f"--device cuda needs 2 GPUs, this machine has {torch.cuda.device_count()}")
            return 1
        for batch in (64, 1):
            one, two = (decode_speed(tp, 1, batch, args.steps, "none", device="cuda")
                        for tp in (1, 2))
            print(f"cuda batch {batch:>2}: tp=1 {one:.1f} tok/s, tp=2 {two:.1f} tok/s, "
                  f"ratio {two / one:.2f}")
        return 0
    msg = message_overhead(args.running, 32)
    print(f"step message, {args.running} running decodes (32-block tables), round trip to a "
          f"worker: {msg * 1e3:.3f} ms (target <= 0.5 ms)")
    for batch in (64, 1):
        for name, t in zip(("gloo", "shared memory (kvserve)"), all_reduce_time(batch)):
            print(f"all_reduce [{batch}, 576] fp32, 2 ranks, {name}: {t * 1e6:.0f} us; x61 "
                  f"per step = {61 * t * 1e3:.2f} ms")
        rows = {"tp=1 x 2 threads (float32)": (1, 2, "none"),
                "tp=2 x 1 thread (float32)": (2, 1, "none"),
                "tp=1 x 2 threads (GGUF kernels)": (1, 2, None)}
        speeds: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(args.repeats):  # interleaved: drift hits every row alike
            for name, (tp, threads, quant) in rows.items():
                speeds[name].append(decode_speed(tp, threads, batch, args.steps, quant))
        med = {k: statistics.median(v) for k, v in speeds.items()}
        for name, v in med.items():
            print(f"batch {batch:>2}  {name:<32} {v:8.1f} tok/s  (runs: "
                  + ", ".join(f"{x:.1f}" for x in speeds[name]) + ")")
        ratio = med["tp=2 x 1 thread (float32)"] / med["tp=1 x 2 threads (float32)"]
        print(f"batch {batch:>2}  tp=2x1 / tp=1x2 (float32): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
