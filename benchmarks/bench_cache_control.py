#!/usr/bin/env python
"""Cache control (issue 33): what the features cost when on, and what a pin buys.

1. overhead: bench_throughput.py's main workload (64 x 128 -> 128, float32, the reference
   model) in this tree, three ways, alternating so that machine drift hits all alike: plain;
   every request with `kv_cache_report`; every request with a `kv_retention` (priority 60, 10
   minutes) under `kv_tenant_quota` 0.5. Prints each median [min-max] and its ratio to plain.
   (Features off against an earlier commit is bench_vs_commit.py's job.)
2. pin: the TTFT of a 2,048-token prefix + 64, in a pool a burst of distinct prompts sweeps:
   cold (nothing cached), cached before the burst, after the burst with the prefix pinned, and
   after the burst unpinned (evicted: a cold TTFT again). Medians of `--samples`.

    .venv/bin/python benchmarks/bench_cache_control.py
    .venv/bin/python benchmarks/bench_cache_control.py --repeats 6 --only overhead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_throughput as bt  # noqa: E402

VARIANTS = {"plain": [], "report": ["--kv-cache-report"], "control": ["--kv-control"]}
WORKLOAD = ["bench", "--engine", "kvserve", "--num-prompts", "64", "--prompt-len", "128",
            "--max-tokens", "128"]


def overhead(model: Path, repeats: int, threads: int, timeout: float) -> dict[str, list[float]]:
    from tqdm import tqdm

    names = list(VARIANTS)
    jobs = [names[r % 3:] + names[:r % 3] for r in range(repeats)]  # rotate the order
    out: dict[str, list[float]] = {n: [] for n in names}
    for order in tqdm(jobs, desc="rounds of 3", unit="round", file=sys.stderr):
        for name in order:
            res = bt.run_worker([*WORKLOAD, *VARIANTS[name], "--model", str(model)], threads,
                                timeout)
            if "error" in res:
                raise RuntimeError(f"{name}: {res['error']}")
            out[name].append(res["tok_s"])
    return out


def _ttft(llm, ids: list[int]) -> tuple[float, int]:
    from kvserve import SamplingParams

    t0 = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
    return time.perf_counter() - t0, out.num_cached_tokens


def pin_ttft(model: Path, samples: int, threads: int, prefix_len: int = 2048) -> dict:
    """TTFT (a one-token request, its whole time) of prefix + 64 in each state."""
    from kvserve import LLM

    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    pool_tokens = 3 * prefix_len
    llm = LLM(model=str(model), dtype="float32", num_threads=threads, block_size=16,
              max_model_len=prefix_len + 128, kv_cache_memory_bytes=pool_tokens * per_token,
              max_pinned_fraction=0.5)
    engine = llm.engine
    rng = random.Random(0)
    vocab = cfg["vocab_size"]

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def burst() -> None:  # 2 x the pool of distinct prompts: every unpinned block goes
        for _ in range(2 * pool_tokens // 1024):
            _ttft(llm, toks(1024))

    _ttft(llm, toks(64))  # warm up
    rows: dict[str, list[float]] = {"cold": [], "cached": [], "pinned after burst": [],
                                    "unpinned after burst": []}
    for _ in range(samples):
        pinned, plain = toks(prefix_len), toks(prefix_len)
        t, _ = _ttft(llm, pinned + toks(64))
        rows["cold"].append(t)
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
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="rounds of the overhead runs (5)")
    p.add_argument("--samples", type=int, default=5, help="TTFT samples per state (5)")
    p.add_argument("--only", default="overhead,pin", help="overhead, pin or both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args()
    parts = {s.strip() for s in args.only.split(",")}
    model = bt.ensure_checkpoint(bt.cache_dir() / "bench-qwen2-small", args.timeout)
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0] \
        if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
           if f" {f}" in flags]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"ISA: {' '.join(isa) or 'baseline'}")
    if "overhead" in parts:
        res = overhead(model, args.repeats, args.threads, args.timeout)
        base = statistics.median(res["plain"])
        print(f"\n64 x 128 -> 128 output tok/s, {args.repeats} runs each, alternating")
        for name, xs in res.items():
            print(f"{name:<8} {statistics.median(xs):9.2f} [{min(xs):.2f}-{max(xs):.2f}]  "
                  f"x{statistics.median(xs) / base:.3f}")
    if "pin" in parts:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        rows = pin_ttft(model, args.samples, args.threads)
        print(f"\nTTFT of a 2,048-token prefix + 64 (one-token request), median of "
              f"{args.samples}, ms")
        for name, xs in rows.items():
            print(f"{name:<22} {1000 * statistics.median(xs):8.1f} "
                  f"[{1000 * min(xs):.1f}-{1000 * max(xs):.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
