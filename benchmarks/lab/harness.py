"""Engines compared on a shared, noisy machine: each measurement in its own subprocess (so
neither engine's memory, threads or caches leak into the other's), the engines alternating
from repeat to repeat, a run that other processes disturbed re-run after a quiet moment, and
medians [min-max] over the repeats. The peer comparisons in benchmarks/ run on this, so that
there is one implementation of the protocol their figures rest on."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvserve.bench.noise import wait_for_quiet

REPO = Path(__file__).resolve().parents[2]


def add_harness_args(p: argparse.ArgumentParser, repeats: int = 3) -> None:
    """The protocol's flags: threads per worker, repeats, the noise threshold and retries."""
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"runs per measurement, engines alternating (default {repeats})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    p.add_argument("--noise-threshold", type=float, default=0.3,
                   help="a run during which other processes (or steal) used more CPU cores "
                        "than this counts as disturbed and is re-run (default 0.3)")
    p.add_argument("--max-retries", type=int, default=2,
                   help="re-runs of a disturbed measurement; the least disturbed is kept")
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each run wait up to this many seconds for quiet (0: never)")


def alternate(engines: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, engine) in run order: the order flips each repeat, so a drift of the machine
    (thermal, a neighbour starting) does not always favour the engine that runs first."""
    return [(r, e) for r in range(repeats) for e in (engines if r % 2 == 0 else engines[::-1])]


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker: its thread count pinned for every BLAS the peers use."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> dict:
    """Run `cmd`, which prints its result as its last JSON line on stdout: that object, or
    {"error": ...} with the tail of its stderr (a failed run is reported, not raised, so one
    failure does not lose the others' figures)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": cmd}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"error": f"exit code {proc.returncode}: {tail}", "cmd": cmd}
    return json.loads(lines[-1])


def run_worker(argv: list[str], threads: int, timeout: float, script: str) -> dict:
    """`script --worker ARGV --threads N` in its own process."""
    cmd = [sys.executable, script, "--worker", *argv, "--threads", str(threads)]
    return run_json(cmd, timeout, worker_env(threads))


def measure(run: Callable[[], dict], args: argparse.Namespace, label: str) -> dict:
    """`run()` once; if other processes took more than --noise-threshold cores during its
    timed part, wait for quiet and run it again (at most --max-retries times). Keeps the least
    disturbed successful attempt, with what the others measured under "discarded"."""
    attempts: list[dict] = []
    for attempt in range(args.max_retries + 1):
        before = wait_for_quiet(args.noise_threshold, args.quiet_wait) \
            if args.quiet_wait > 0 else None
        res = run()
        res.update(attempt=attempt, foreign_cores_before=before)
        attempts.append(res)
        if "error" in res or res.get("foreign_cores", 0.0) < args.noise_threshold:
            break
        if attempt < args.max_retries:
            print(f"{label}: disturbed (others used {res['foreign_cores']:.2f} cores), "
                  "re-running", file=sys.stderr, flush=True)
    good = [a for a in attempts if "error" not in a]
    kept = min(good, key=lambda a: a.get("foreign_cores", 0.0)) if good else attempts[-1]
    kept["retries"] = len(attempts) - 1
    kept["discarded"] = [{k: a.get(k) for k in ("tok_s", "wall_s", "foreign_cores", "error")
                          if k in a} for a in attempts if a is not kept]
    return kept


def worker_output(fn: Callable[[], dict]) -> int:
    """Run a worker's body with stdout kept for its one JSON line (libraries that print go to
    stderr), then print the result."""
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        result = fn()
    finally:
        sys.stdout = real
    print(json.dumps(result), flush=True)
    return 0
