#!/usr/bin/env python
"""kvserve against an earlier kvserve: this tree and a base commit, side by side, in one run.

For a refactor that must not slow anything down: each workload's worker (the ones
bench_throughput.py and bench_prefix_cache.py run) is started from this working tree and from a
checkout of `--base`, alternating A B B A A B ..., so machine drift hits both alike. Prints each
workload's median [min-max] for both trees and the ratio new/old of the medians, where above 1
means this tree is faster.

Workloads (float32, the reference model of bench_throughput.py, or `--model`: a checkpoint, or
"default" for the embedded SmolLM2 GGUF, run on its quantized kernels):
  throughput  64 x 128 -> 128 tokens, output tok/s
  batch32     32 x 128 -> 128, output tok/s
  batch16     16 x 128 -> 128, output tok/s
  batch1      1 x 128 -> 128, output tok/s
  ttft-cold   TTFT of a 2,048-token prompt + 64, nothing cached (1 / TTFT)
  ttft-cached the same prompt with its 2,048-token prefix cached (1 / TTFT)
  shared      16 x (1,024 shared + 32) -> 32, output tok/s (the prefix computed once)

    .venv/bin/python benchmarks/bench_vs_commit.py --base 045d1c4
    .venv/bin/python benchmarks/bench_vs_commit.py --base HEAD~3 --repeats 3 --only throughput
    .venv/bin/python benchmarks/bench_vs_commit.py --base HEAD~1 --model default \
        --only batch1,batch32

An A/A run (the base against itself, to read the spread a ratio must fall inside): run the
base's own copy of this script, which compares its tree with the base, e.g.
`git worktree add /tmp/aa <base>` then `.venv/bin/python /tmp/aa/benchmarks/bench_vs_commit.py
--base <base>` (this repository's .venv; each tree's workers import their own kvserve).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_throughput as bt  # noqa: E402

# name -> (script, worker argv without --model, metric reader: result -> "higher is better")
WORKLOADS = {
    "throughput": ("bench_throughput.py", ["bench", "--engine", "kvserve", "--num-prompts", "64",
                                           "--prompt-len", "128", "--max-tokens", "128"],
                   lambda r: r["tok_s"]),
    "batch32": ("bench_throughput.py", ["bench", "--engine", "kvserve", "--num-prompts", "32",
                                        "--prompt-len", "128", "--max-tokens", "128"],
                lambda r: r["tok_s"]),
    # a decode batch in the second row bucket (5-32 rows), where the panel GEMM runs on AVX2
    "batch16": ("bench_throughput.py", ["bench", "--engine", "kvserve", "--num-prompts", "16",
                                        "--prompt-len", "128", "--max-tokens", "128"],
                lambda r: r["tok_s"]),
    "batch1": ("bench_throughput.py", ["bench", "--engine", "kvserve", "--num-prompts", "1",
                                       "--prompt-len", "128", "--max-tokens", "128"],
               lambda r: r["tok_s"]),
    "ttft-cold": ("bench_prefix_cache.py", ["ttft", "--prefix-lens", "2048", "--samples", "5",
                                            "--suffix-len", "64", "--max-retries", "0"],
                  lambda r: 1.0 / statistics.median(s["ttft_s"]
                                                    for s in r["samples"]["cold"]["2048"])),
    "ttft-cached": ("bench_prefix_cache.py", ["ttft", "--prefix-lens", "2048", "--samples", "5",
                                              "--suffix-len", "64", "--max-retries", "0"],
                    lambda r: 1.0 / statistics.median(s["ttft_s"]
                                                      for s in r["samples"]["cached"]["2048"])),
    "shared": ("bench_prefix_cache.py", ["shared", "--engine", "kvserve", "--num-prompts", "16",
                                         "--shared-prefix", "1024", "--shared-unique", "32",
                                         "--max-tokens", "32"],
               lambda r: r["tok_s"]),
}
# ttft-cold and ttft-cached come out of one worker run
_RUN_ONCE = {"ttft-cached": "ttft-cold"}


def checkout(base: str, into: Path) -> Path:
    repo = bt.REPO
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(into), base],
                   check=True, capture_output=True)
    return into


def run_worker(tree: Path, script: str, argv: list[str], threads: int, timeout: float) -> dict:
    """One worker of `tree`'s own benchmark script, importing `tree`'s kvserve."""
    res = bt.run_worker(argv, threads, timeout, script=str(tree / "benchmarks" / script),
                        tree=tree)
    if "error" in res:
        raise RuntimeError(f"{' '.join(map(str, res.get('cmd', [])))} failed: {res['error']}")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--repeats", type=int, default=5, help="runs per tree and workload (5)")
    p.add_argument("--only", default=",".join(WORKLOADS),
                   help=f"comma list of workloads ({','.join(WORKLOADS)})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    p.add_argument("--model", help="checkpoint to run (default: the reference model; "
                   "'default': the embedded SmolLM2 GGUF)")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if any(n not in WORKLOADS for n in names):
        p.error(f"--only takes workloads from {', '.join(WORKLOADS)}")

    from tqdm import tqdm

    if args.model == "default":
        from kvserve.model_loader.default import embedded_model_path

        model = embedded_model_path()
    elif args.model:
        model = Path(args.model)
    else:
        model = bt.ensure_checkpoint(bt.cache_dir() / "bench-qwen2-small", args.timeout)
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0] \
        if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"ISA: {' '.join(isa) or 'baseline'}")
    results: dict[str, dict[str, list[float]]] = {n: {"old": [], "new": []} for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = checkout(args.base, Path(tmp) / "base")
        trees = {"old": old_tree, "new": bt.REPO}
        runs = [n for n in names if n not in _RUN_ONCE or _RUN_ONCE[n] not in names]
        jobs = [(r, n, side) for r in range(args.repeats) for n in runs
                for side in (("old", "new") if r % 2 == 0 else ("new", "old"))]
        try:
            for r, name, side in tqdm(jobs, desc="old/new pairs", unit="run", file=sys.stderr):
                script, argv, _ = WORKLOADS[name]
                res = run_worker(trees[side], script, [*argv, "--model", str(model)],
                                 args.threads, args.timeout)
                for n in names:  # every workload this run measured
                    if WORKLOADS[n][:2] == (script, argv):
                        results[n][side].append(WORKLOADS[n][2](res))
        finally:
            subprocess.run(["git", "-C", str(bt.REPO), "worktree", "remove", "--force",
                            str(old_tree)], capture_output=True)

    print(f"\nmodel {model}; base {args.base} (old) vs this tree (new), {args.repeats} runs each, "
          "higher is better (TTFT as 1/s)")
    print(f"{'workload':<12} {'old median [min-max]':>28} {'new median [min-max]':>28} "
          f"{'new/old':>8}")
    for n in names:
        old, new = results[n]["old"], results[n]["new"]
        ratio = statistics.median(new) / statistics.median(old)
        print(f"{n:<12} {_fmt(old):>28} {_fmt(new):>28} {ratio:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "results": results}, indent=1))
    return 0


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


if __name__ == "__main__":
    sys.exit(main())
