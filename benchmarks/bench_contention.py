#!/usr/bin/env python
"""Batch-1 decode beside one busy process (issue 31): how much of its quiet speed an engine
keeps when a single-threaded competitor (`python -c "while True: pass"`) shares the CPU.

Why: OpenMP's fork/join waits at its barrier for every thread of the team; with a competitor
on one of two cores a descheduled team thread holds each of a decode step's ~120 kernel calls
for a time slice. kvserve's quantized kernel claims work from a pool instead
(kernels/cpu/csrc/parallel.h); KVSERVE_CPU_POOL=omp runs the same kernel on OpenMP, the
comparison here.

Each run is a subprocess: the default model (the Q4_1 GGUF, quantization "gguf"), --threads
threads, one prompt of --prompt-len random token ids -> --output-len greedy tokens
(ignore_eos), decode tok/s from the first to the last token. Runs alternate kernel pools and
quiet / busy, --repeats rounds; medians. With --llama-bench PATH --gguf FILE llama.cpp's
`llama-bench -m FILE -t T -p 0 -n N -r 3 -o json` runs in the same rounds, quiet and busy.
On a machine shared with other work "quiet" is only as quiet as the machine: read the
figures as indicative, and the busy/quiet fractions within one round.

    PYTHONPATH=. python benchmarks/bench_contention.py [--repeats 3] \\
        [--llama-bench /path/to/llama-bench --gguf /path/to/model.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = [sys.executable, "-c", "while True: pass"]


def worker(args: argparse.Namespace) -> None:
    import random

    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.model_loader.default import embedded_model_path

    torch.set_num_threads(args.threads)
    llm = LLM(model=str(embedded_model_path()), num_threads=args.threads, max_num_seqs=2,
              max_model_len=args.prompt_len + args.output_len + 16, seed=0)
    vocab = llm.engine.tokenizer.vocab_size if hasattr(llm.engine.tokenizer, "vocab_size") \
        else 32000
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, min(vocab, 32000)) for _ in range(args.prompt_len)]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:8]}], warm, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompt}], warm, use_tqdm=False)  # prefill's first use
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    print(json.dumps({"decode_tok_s": (n - 1) / (m.last_token_time - m.first_token_time),
                      "tokens": n}))


def cpu_flags() -> str:
    sys.path.insert(0, str(ROOT))
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().flags_line()


def run_kvserve(args: argparse.Namespace, pool: str) -> float | None:
    env = dict(os.environ, KVSERVE_CPU_POOL=pool, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--worker", "--threads", str(args.threads),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  kvserve ({pool}) failed: {proc.stderr.strip()[-1500:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["decode_tok_s"]


def run_llama_bench(args: argparse.Namespace) -> float | None:
    cmd = [args.llama_bench, "-m", args.gguf, "-t", str(args.threads), "-p", "0", "-n",
           str(args.output_len), "-r", "3", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    try:
        rows = json.loads(proc.stdout)
        return float(next(r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0))
    except (ValueError, StopIteration, KeyError, TypeError):
        print(f"  llama-bench failed: {proc.stderr.strip()[-1500:]}", file=sys.stderr)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--pools", default="omp,pool", help="KVSERVE_CPU_POOL values to compare")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary")
    ap.add_argument("--gguf", help="the GGUF file llama-bench runs (--llama-bench)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.llama_bench and not args.gguf:
        ap.error("--llama-bench needs --gguf")
    print(cpu_flags())
    print(f"{args.threads} threads, prompt {args.prompt_len} -> {args.output_len} tokens, "
          f"competitor: {' '.join(BUSY)}")
    engines = [f"kvserve-{p}" for p in args.pools.split(",")]
    if args.llama_bench:
        engines.append("llama.cpp")
    results: dict[tuple[str, str], list[float]] = {(e, c): [] for e in engines
                                                   for c in ("quiet", "busy")}
    for r in range(args.repeats):
        order = engines if r % 2 == 0 else engines[::-1]
        for cond in (("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")):
            for e in order:
                busy = subprocess.Popen(BUSY) if cond == "busy" else None
                try:
                    time.sleep(0.2 if busy else 0)
                    v = run_llama_bench(args) if e == "llama.cpp" \
                        else run_kvserve(args, e.split("-", 1)[1])
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                if v is not None:
                    results[(e, cond)].append(v)
                print(f"  round {r + 1} {e:<13} {cond:<5}: "
                      + ("failed" if v is None else f"{v:6.1f} tok/s"), flush=True)
    print("\nmedian decode tok/s (quiet / busy / fraction kept):")
    for e in engines:
        q, b = results[(e, "quiet")], results[(e, "busy")]
        if not q or not b:
            print(f"  {e:<13} no result")
            continue
        mq, mb = statistics.median(q), statistics.median(b)
        print(f"  {e:<13} {mq:6.1f} / {mb:6.1f} / {mb / mq:5.2f}   (quiet {q}, busy {b})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
