"""How fast `kvserve simulate` replays a block-hash trace through the real KV-cache code.

Generates a Mooncake-shaped trace (`hash_mix`: 512-token blocks, Poisson arrivals in ms, popular
system prompts and multi-turn sessions; default 100,000 requests), writes it as JSONL, reads it
back the way `kvserve simulate trace.jsonl` does, and times the replay (the KV pool per replica
is `--capacity` tokens). Prints requests per second of replay, the time to load the trace, and
the hit rate. The target: 100,000 requests in under 60 s on the project's 2-core machine.

    .venv/bin/python benchmarks/bench_simulator.py
    .venv/bin/python benchmarks/bench_simulator.py --num-requests 20000 --policy lru,belady
    .venv/bin/python benchmarks/bench_simulator.py --trace my_trace.jsonl --capacity 2M
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.planner.units import parse_tokens  # noqa: E402
from kvserve.sim.generators import hash_mix  # noqa: E402
from kvserve.sim.replay import SimConfig, replay  # noqa: E402
from kvserve.sim.trace import load_trace, write_trace  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead")
    p.add_argument("--capacity", default="1M", help="KV pool in tokens (default 1M = 2,048 "
                   "blocks of 512)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default: the trace's hash block size, 512)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--lifetime", choices=["timed", "immediate"], default="timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    t0 = time.perf_counter()
    if args.trace:
        path = args.trace
        gen_s = 0.0
    else:
        trace = hash_mix(num_requests=args.num_requests, seed=args.seed)
        fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="kvserve-hashmix-")
        os.close(fd)
        write_trace(trace, path)
        del trace
        gen_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trace = load_trace(path)
    load_s = time.perf_counter() - t1
    s = trace.summary()
    print(f"trace: {s['num_requests']:,} requests, mean prompt {s['mean_input_length']:,.0f} "
          f"tokens, {s['input_tokens']:,} prompt tokens, {s['duration_s'] or 0:,.0f} s of "
          f"arrivals (generated + written in {gen_s:.1f} s, loaded in {load_s:.1f} s)")
    results = []
    for policy in args.policy.split(","):
        cfg = SimConfig(capacity_tokens=parse_tokens(args.capacity),
                        block_size=args.block_size or trace.block_size, policy=policy,
                        lifetime=args.lifetime)
        c0 = time.process_time()
        r = replay(trace, cfg)
        r["cpu_s"] = time.process_time() - c0  # the machines are shared: wall time is noisy
        del r["per_replica"]
        results.append(r)
        print(f"{policy:<8} capacity {r['capacity_tokens']:,} tokens ({r['capacity_blocks']:,} "
              f"blocks of {r['block_size']}): replay {r['elapsed_s']:.1f} s "
              f"({r['cpu_s']:.1f} s CPU) = {r['requests_per_s']:,.0f} requests/s; hit rate {r['hit_rate'] * 100:.2f}%, "
              f"{r['evicted_blocks']:,} blocks evicted, peak usage {r['peak_usage'] * 100:.1f}%")
    if not args.trace:
        os.unlink(path)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(trace=s, load_s=load_s, runs=results),
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
