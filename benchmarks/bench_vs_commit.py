"""No slowdown against a commit: this tree's engine and a base commit's, each in its own worker
process, measured in turns on the same prompts (a refactor's check, issue 65 acceptance 4).

Each worker loads the model once and waits; the parent asks one worker at a time for a repeat
(the order alternating per repeat), so the two never run together. Figures: prefill of a fresh
512-token prompt (seconds, one token out), batch-1 decode (128 tokens after 64) and batch 32
(32 x 128 -> 128). Medians of the repeats; the ratio is this tree over the base (seconds: lower
is better). `--aa` runs the base against itself: the spread this machine shows for identical code.

    .venv/bin/python benchmarks/bench_vs_commit.py --base a7bf21f --repeats 5
    .venv/bin/python benchmarks/bench_vs_commit.py --base a7bf21f \\
        --model ~/.cache/kvserve/gguf-models/llama-3.2-1b/Q4_K_M.gguf --workloads prefill512,batch1

Never beside another job: on 2 cores a second process slows both many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.record import (Row, add_record_arg, current_command, current_machine, ratio,
                                  write_record)

ROOT = Path(__file__).resolve().parent.parent

# The worker imports only the public API (`kvserve.LLM`), which every commit has.
WORKER = r"""
import gc, json, random, sys, time
from kvserve import LLM, SamplingParams
model = sys.argv[1] or None
llm = LLM(model=model, enable_prefix_caching=False, max_model_len=4096, seed=0)
vocab = min(llm.engine.model_config.vocab_size, 32000)

def prompts(n, length, seed):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(n)]

def timed(p, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(p, sp, use_tqdm=False)
    return time.perf_counter() - t

def measure(seed, workloads):
    out = {}
    if "prefill512" in workloads:
        out["prefill512"] = timed(prompts(1, 512, seed + 512), 1)
    if "batch1" in workloads:
        first = timed(prompts(1, 64, seed), 1)
        out["batch1"] = 127 / (timed(prompts(1, 64, seed + 1), 128) - first)
    if "batch32" in workloads:
        out["batch32"] = 32 * 128 / timed(prompts(32, 128, seed), 128)
    return out

measure(0, ["prefill512", "batch1"])  # warm: kernels built, choices measured, pages in
print("ready", flush=True)
for line in sys.stdin:
    seed, workloads = line.split()
    gc.collect()
    print(json.dumps(measure(int(seed), workloads.split(","))), flush=True)
"""

FIGURES = {"prefill512": ("prefill, a fresh 512-token prompt", "s"),
           "batch1": ("batch-1 decode, 64 -> 128", "tok/s"),
           "batch32": ("batch 32, 32 x 128 -> 128", "tok/s")}


def _checkout(commit: str) -> Path:
    """A detached worktree of `commit` in a temporary directory."""
    path = Path(tempfile.mkdtemp(prefix="kvserve-base-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
                   check=True, capture_output=True)
    return path


def _worker(tree: Path, model: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, model], cwd=tree, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while (line := proc.stdout.readline()).strip() != "ready":
        if not line:
            raise RuntimeError(f"the worker in {tree} exited before it was ready")
    return proc


def _ask(proc: subprocess.Popen, seed: int, workloads: str) -> dict[str, float]:
    proc.stdin.write(f"{seed} {workloads}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--model", default="", help="default: the embedded SmolLM2 Q4_1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workloads", default=",".join(FIGURES))
    ap.add_argument("--aa", action="store_true", help="the base against itself")
    add_record_arg(ap, "no-slowdown")
    args = ap.parse_args()
    print(current_machine(), flush=True)
    base = _checkout(args.base)
    trees = {"base": base, "this": base if args.aa else ROOT}
    try:
        procs = {name: _worker(tree, args.model) for name, tree in trees.items()}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in procs}
        for r in range(args.repeats):
            for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
                runs[name].append(_ask(procs[name], 1000 * (r + 1), args.workloads))
                print(f"repeat {r} {name}: {runs[name][-1]}", flush=True)
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       capture_output=True)
    label = "base (A/A)" if args.aa else "this"
    print(f"\n{'figure':<36} {'base':>9} {label:>11} {'ratio':>7}  (medians of {args.repeats})")
    rows = []
    for key in args.workloads.split(","):
        b = statistics.median(x[key] for x in runs["base"])
        t = statistics.median(x[key] for x in runs["this"])
        name, unit = FIGURES[key]
        print(f"{name:<36} {b:>9.3f} {t:>11.3f} {t / b:>6.3f}x  {unit}")
        spread = [x[key] for x in runs["this"]]
        rows.append(Row(f"{name} [{min(spread):.3f}-{max(spread):.3f}]", unit, round(t, 4),
                        round(b, 4), ratio(t, b)))
    if args.record:
        model = f"{Path(args.model).parent.name}/{Path(args.model).name}" if args.model \
            else "SmolLM2-135M Q4_1 (embedded)"
        stem = f"{Path(args.model).parent.name}-{Path(args.model).stem}" if args.model \
            else "smollm2"
        write_record(args.record, rows=rows, command=current_command().replace(
                         str(Path.home()), "~"), peer=f"the base commit {args.base}"
                     + (" against itself (A/A)" if args.aa else ""),
                     name=f"bench-vs-commit-{stem}{'-aa' if args.aa else ''}".lower()
                     .replace("_", "-").replace(".", "-"),
                     title=f"this tree against {args.base}: {model}"
                     + (" (A/A: the base against itself)" if args.aa else ""),
                     notes=f"medians of {args.repeats} alternated repeats, [min-max] of this "
                           "tree's; ratio this / base (prefill: seconds, lower is better; "
                           "decode: tok/s, higher is better)")


if __name__ == "__main__":
    main()
