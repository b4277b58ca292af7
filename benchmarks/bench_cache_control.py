#!/usr/bin/env python
"""What a pin buys (issue 33): the TTFT of a 2,048-token prefix + 64 in a pool that a burst of
distinct prompts sweeps: cold (nothing cached), cached before the burst, after the burst with
the prefix pinned, and after the burst unpinned (evicted: a cold TTFT again). Medians of
`--samples`, on the reference model (float32).

    .venv/bin/python benchmarks/bench_cache_control.py [--samples 5] [--record]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import _repo_root  # noqa: F401  (the repo root on sys.path: benchmarks.lab)
from kvserve.bench.record import (add_record_arg, current_machine, ratio,
                                  write_record)
from benchmarks.lab.reference import ensure_checkpoint


def _ttft(llm, ids: list[int]) -> tuple[float, int]:
    from kvserve import SamplingParams

    t0 = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
    return time.perf_counter() - t0, out.num_cached_tokens


def pin_ttft(model: Path, samples: int, threads: int, prefix_len: int) -> dict:
    """TTFT (a one-token request, its whole time) of prefix + 64 in each state."""
    from kvserve import LLM
    from kvserve.planner.memory import kv_cache_spec
    from kvserve.planner.model import ModelSpec

    per_token = kv_cache_spec(ModelSpec.load(str(model)), "fp32").bytes_per_token
    pool_tokens = 3 * prefix_len
    llm = LLM(model=str(model), dtype="float32", num_threads=threads, block_size=16,
              max_model_len=prefix_len + 128, kv_cache_memory_bytes=pool_tokens * per_token,
              max_pinned_fraction=0.5)
    engine = llm.engine
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, engine.model_config.vocab_size) for _ in range(n)]

    def burst() -> None:  # 2 x the pool of distinct prompts: every unpinned block goes
        for _ in range(2 * pool_tokens // (prefix_len // 2)):
            _ttft(llm, toks(prefix_len // 2))

    _ttft(llm, toks(64))  # warm up
    rows: dict[str, list[float]] = {"cold": [], "cached": [], "pinned after burst": [],
                                    "unpinned after burst": []}
    for _ in range(samples):
        pinned, plain = toks(prefix_len), toks(prefix_len)
        rows["cold"].append(_ttft(llm, pinned + toks(64))[0])
        _ttft(llm, plain + toks(64))
        t, hit = _ttft(llm, pinned + toks(64))
        assert hit >= prefix_len, hit
        rows["cached"].append(t)
        pin = engine.pin_prefix({"prompt_token_ids": pinned})
        assert pin is not None and pin["num_tokens"] == prefix_len, pin
        burst()
        t, hit = _ttft(llm, pinned + toks(64))
        assert hit >= prefix_len, f"the pinned prefix lost blocks: {hit} cached"
        rows["pinned after burst"].append(t)
        t, hit = _ttft(llm, plain + toks(64))
        rows["unpinned after burst"].append(t)
        assert hit < 64, f"the unpinned prefix survived the burst: {hit} cached"
        engine.unpin(pin["id"])
    return {k: 1000 * statistics.median(v) for k, v in rows.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="default: the reference checkpoint (benchmarks.lab.reference)")
    p.add_argument("--samples", type=int, default=5, help="TTFT samples per state (5)")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    add_record_arg(p, "prefix-caching")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(current_machine())
    model = args.model or ensure_checkpoint()
    ms = pin_ttft(model, args.samples, args.threads, args.prefix_len)
    print(f"\nTTFT of a {args.prefix_len:,}-token prefix + 64 (one-token request), median of "
          f"{args.samples}, ms")
    for name, v in ms.items():
        print(f"{name:<22} {v:8.1f}")
    if args.record:
        pairs = (("TTFT pinned after the burst / cached before it", "pinned after burst",
                  "cached"), ("TTFT not pinned after the burst / cold", "unpinned after burst",
                              "cold"))
        write_record(args.record, title="Cache control: a pin keeps the cached TTFT through "
                     "a burst (issue 33)", peer="none: kvserve against itself (cold, unpinned)",
                     rows=[{"figure": f, "unit": "ms", "kvserve": round(ms[a], 1),
                            "peer": round(ms[b], 1), "ratio": ratio(ms[a], ms[b])}
                           for f, a, b in pairs],
                     notes=f"Median of {args.samples}, float32, {model.name}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
