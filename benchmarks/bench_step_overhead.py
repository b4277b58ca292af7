#!/usr/bin/env python
"""What one engine step costs outside the forward pass: the scheduler and the KV manager, with a
null model, at 256 and 1,024 running requests.

Each request has a 128-token prompt (every 4th shares a 64-token prefix, so the prefix cache
works) and decodes until the run ends. A step here is exactly the engine's non-model work:
`Scheduler.schedule()` (allocation, admission, the step plan, the step message the worker gets)
and `Scheduler.update_from_output()` (computed counts, publishing full blocks to the prefix
index, appending each sampled token and checking its stops); drawing the "sampled" tokens is
not timed (it is the worker's sampler). Prints the median and p90 per decode step once every
request is running, and, apart, what sending the step message to another process would add:
its pickled size and the time to pickle it (a worker in the same process reads it as it is).

    .venv/bin/python benchmarks/bench_step_overhead.py
    .venv/bin/python benchmarks/bench_step_overhead.py --running 256,1024,4096 --steps 300
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.scheduler import Scheduler  # noqa: E402
from kvserve.worker.step import StepOutput  # noqa: E402
from kvserve.kv.manager import KVCacheManager  # noqa: E402
from kvserve.kernels.cpu.cpu_features import cpu_info  # noqa: E402
from kvserve.request import Request  # noqa: E402
from kvserve.sampling import SamplingParams  # noqa: E402


def run(num_running: int, steps: int, block_size: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    max_len = 128 + steps + 64
    config = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running),
                          block_size=block_size, device="cpu")
    config.finalize(max_len)
    blocks = num_running * -(-max_len // block_size) + 64
    kv = KVCacheManager(blocks, block_size)
    sched = Scheduler(config, kv)
    shared = [rng.randrange(32000) for _ in range(64)]
    params = SamplingParams(max_tokens=max_len - 128)
    for i in range(num_running):
        tail = [rng.randrange(32000) for _ in range(64 if i % 4 == 0 else 128)]
        prompt = shared + tail if i % 4 == 0 else tail
        sched.add(Request(str(i), prompt, params, max_len - 128))
    times, pickled, sizes = [], [], []
    for step in range(steps):
        t = time.perf_counter()
        batch = sched.schedule()
        elapsed = time.perf_counter() - t
        t = time.perf_counter()
        message = pickle.dumps(batch.step, protocol=pickle.HIGHEST_PROTOCOL)
        pickle_s = time.perf_counter() - t
        sampled = [i for i, seq in enumerate(batch.step.seqs) if seq.samples]
        out = StepOutput(sampled=sampled, tokens=[rng.randrange(32000) for _ in sampled],
                         logprobs=[None] * len(sampled))
        t = time.perf_counter()
        sched.update_from_output(batch, out)
        elapsed += time.perf_counter() - t
        if not sched.waiting and all(n == 1 for n in batch.num_new_tokens):
            times.append(elapsed)
            pickled.append(pickle_s)
            sizes.append(len(message))
    times.sort()
    return {"running": num_running, "decode_steps": len(times),
            "median_ms": 1000 * statistics.median(times),
            "p90_ms": 1000 * times[int(0.9 * (len(times) - 1))],
            "pickle_ms": 1000 * statistics.median(pickled),
            "message_kb": statistics.median(sizes) / 1024}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="256,1024", help="running requests, comma list")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    print(f"cpu: {cpu_info().summary()}; load average {os.getloadavg()[0]:.1f} "
          f"(1 min) at start")
    print(f"{'running':>8} {'decode steps':>13} {'median ms/step':>15} {'p90 ms/step':>12}"
          f" {'pickle ms':>10} {'message KB':>11}")
    for n in (int(x) for x in args.running.split(",")):
        r = run(n, args.steps, args.block_size)
        print(f"{r['running']:>8} {r['decode_steps']:>13} {r['median_ms']:>15.3f} "
              f"{r['p90_ms']:>12.3f} {r['pickle_ms']:>10.3f} {r['message_kb']:>11.1f}")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
