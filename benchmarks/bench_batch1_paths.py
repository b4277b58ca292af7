#!/usr/bin/env python
"""Batch-1 decode tok/s of kvserve's GEMM paths side by side: the C++ GEMV with its fused norm
and RoPE (`KVSERVE_GEMM=gemv`), MKL with torch element-wise ops (`dense`), and what the
measurement at load picks (`auto`).

One process per path and repeat, alternating, each: the reference model (bench_throughput's
cached bench-qwen2-small, fp32), one prompt of --prompt-len random ids -> --output-len greedy
tokens, --runs timed generates after a warm-up; decode tok/s = (n - 1) / (last - first token
time). Prints every run and the median per path, with the CPU flags and the load average.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_batch1_paths.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from kvserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", num_threads=args.threads, max_num_seqs=2,
              max_model_len=args.prompt_len + args.output_len + 16, block_size=16)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
    llm.generate([{"prompt_token_ids": prompt[:8]}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates, tokens = [], []
    for _ in range(args.runs):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        rates.append((len(tokens) - 1) / (out.metrics.last_token_time
                                          - out.metrics.first_token_time))
    plan = llm.engine.model.gemm_plan
    return {"rates": rates, "tokens": tokens,
            "plan": plan.describe() if plan is not None else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default="gemv,dense,auto")
    p.add_argument("--repeats", type=int, default=2, help="processes per path")
    p.add_argument("--runs", type=int, default=3, help="timed generates per process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    sys.path.insert(0, str(BENCH_DIR))
    import bench_throughput as bt

    from kvserve.kernels.cpu.cpu_features import cpu_info

    model = args.model or str(bt.ensure_checkpoint(bt.cache_dir() / "bench-qwen2-small", 900))
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    load = [os.getloadavg()[0]]
    rates: dict[str, list[float]] = {x: [] for x in paths}
    tokens: dict[str, list[int]] = {}
    for r in range(args.repeats):
        for path in paths if r % 2 == 0 else paths[::-1]:
            env = dict(os.environ, KVSERVE_GEMM=path, OMP_NUM_THREADS=str(args.threads))
            cmd = [sys.executable, __file__, "--worker", "--model", model, "--threads",
                   str(args.threads), "--runs", str(args.runs), "--prompt-len",
                   str(args.prompt_len), "--output-len", str(args.output_len)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"{path} failed: {proc.stderr.strip()[-1500:]}", file=sys.stderr)
                continue
            res = json.loads(lines[-1])
            rates[path] += res["rates"]
            tokens[path] = res["tokens"]
            print(f"  {path:<6} {', '.join(f'{x:.1f}' for x in res['rates'])} tok/s"
                  f"{'  (' + res['plan'] + ')' if res['plan'] and path == 'auto' else ''}")
    load.append(os.getloadavg()[0])
    print(f"\nbatch-1 decode, 1 x {args.prompt_len} -> {args.output_len}, float32, "
          f"{args.threads} threads; cpu: {cpu_info().summary()}; load average "
          f"{load[0]:.1f} at start, {load[1]:.1f} at end")
    for path, xs in rates.items():
        if xs:
            print(f"  {path:<6} median {statistics.median(xs):.1f} tok/s "
                  f"[{min(xs):.1f}-{max(xs):.1f}] over {len(xs)} runs")
    if len({tuple(t) for t in tokens.values()}) > 1:
        print("  WARNING: the paths' greedy tokens differ")
    elif tokens:
        print("  greedy tokens identical across paths")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
