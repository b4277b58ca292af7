#!/usr/bin/env python
"""Differential soak: tests/test_differential.py's random workloads for as long as you like.

Each workload (tests/differential.py: shared prefixes with partial-block hits, n > 1, aborts,
preemption in a small pool, chunked prefill, eviction into the tiers, write-back and
write-through, and load/copy races) is generated from a seeded random.Random and run through
the public engine API three times: prefix caching off, prefix caching on with tiers off (the
reference), and tiers on with the next tier combination in turn (host, host+disk, host+Redis,
host+disk+Redis; a redis-server is started here on a free port, disk tiers use fresh temp
dirs). Prefix-on must equal prefix-off, and tiers-on must equal tiers-off: same greedy tokens,
logprobs within 1e-4 (fp32). Every step is followed by the engine's invariant check and every
run by a leak check; an invariant failure or a leak is counted as a failed workload too.

Prints how many workloads and requests were compared and how many differed, by tier
combination, and the seeds of the first differing workloads (rerun one with --seed S
--workloads 1 --verbose). Exit status 1 if anything differed.

    .venv/bin/python benchmarks/soak_differential.py --minutes 10 --seed 0
    .venv/bin/python benchmarks/soak_differential.py --workloads 20 --verbose   # smoke
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import differential as d  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from tqdm import tqdm  # noqa: E402


def make_model(root: Path) -> Path:
    """conftest's transformers-made Llama checkpoint (wide weights: greedy tokens depend on the
    whole context, so a wrong KV block shows)."""
    from conftest import make_hf_checkpoint

    return make_hf_checkpoint("llama", root / "llama")


def soak_one(model_dir: Path, seed: int, combo: str,
             redis: RedisServer) -> tuple[int, list[tuple[str, str]]]:
    """Run one workload three ways; return (requests compared, [(pair, difference)]): each
    difference starts with "<request id>#<sample>"."""
    w = d.make_workload(d.RandomChooser(random.Random(seed)))
    plain = d.run(d.make_llm(model_dir, w, prefix_caching=False), w)
    ref = d.run(d.make_llm(model_dir, w), w)
    diffs = [("prefix caching", x) for x in d.compare(plain, ref)]
    if "redis" in combo:
        redis.client().flushall()
    tiers = d.Tiers(combo, redis_url=redis.url)
    llm = d.make_llm(model_dir, w, tiers=tiers)
    try:
        got = d.run(llm, w)
    finally:
        llm.engine.shutdown()
        tiers.cleanup()
    diffs += [(f"tiers {combo}", x) for x in d.compare(ref, got)]
    return len(ref.outputs), diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to soak")
    ap.add_argument("--workloads", type=int, default=None, help="stop after this many instead")
    ap.add_argument("--seed", type=int, default=0, help="workload i uses seed SEED + i")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--verbose", action="store_true", help="print every difference")
    args = ap.parse_args()

    import os

    import torch

    os.environ.setdefault("KVSERVE_LOGGING_LEVEL", "WARNING")  # not one line per engine

    model_dir = make_model(Path(tempfile.mkdtemp(prefix="kvserve-soak-")))
    # After make_model: importing tests/conftest.py sets 2 threads, and two threads spinning
    # at every tiny GEMM's barrier on a busy machine are many times slower than one.
    torch.set_num_threads(args.threads)
    redis = RedisServer()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    workloads, requests = Counter(), Counter()
    bad_workloads, bad_requests = Counter(), Counter()
    first_bad: list[int] = []
    bar = tqdm(desc="workloads", unit="wl", total=args.workloads)
    i = 0
    try:
        while time.monotonic() < deadline and (args.workloads is None or i < args.workloads):
            seed = args.seed + i
            combo = d.TIER_COMBOS[i % len(d.TIER_COMBOS)]
            try:
                n, diffs = soak_one(model_dir, seed, combo, redis)
            except Exception:  # an invariant, a leak, a crash: a failed workload
                n, diffs = 0, [("error", "?# " + traceback.format_exc(limit=3))]
            workloads[combo] += 1
            requests[combo] += n
            if diffs:
                bad_workloads[combo] += 1
                bad_requests[combo] += len({msg.split("#", 1)[0] for _, msg in diffs})
                if len(first_bad) < 10:
                    first_bad.append(seed)
                if args.verbose:
                    tqdm.write(f"seed {seed} ({combo}):\n  " + "\n  ".join(
                        f"{pair}: {msg}" for pair, msg in diffs))
            i += 1
            bar.update(1)
            bar.set_postfix(differed=sum(bad_workloads.values()))
    finally:
        bar.close()
        redis.close()
    elapsed = time.monotonic() - start
    print(f"\n{sum(workloads.values())} workloads, {sum(requests.values())} requests compared in "
          f"{elapsed / 60:.1f} min (seeds {args.seed}..{args.seed + i - 1})")
    print(f"{'tiers':<18}{'workloads':>10}{'requests':>10}{'differed wl':>13}{'differed req':>14}")
    for combo in d.TIER_COMBOS:
        print(f"{combo:<18}{workloads[combo]:>10}{requests[combo]:>10}"
              f"{bad_workloads[combo]:>13}{bad_requests[combo]:>14}")
    if first_bad:
        print("first differing seeds:", first_bad)
    return 1 if first_bad else 0


if __name__ == "__main__":
    sys.exit(main())
