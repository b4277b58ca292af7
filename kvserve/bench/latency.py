"""`kvserve bench latency`: the latency of one batch through the offline `LLM`, as `vllm bench
latency` measures it: --batch-size prompts of --input-len random tokens, each generating exactly
--output-len tokens; --num-iters-warmup unmeasured runs, then --num-iters measured ones;
reported: the mean and the percentiles of the batch's end-to-end latency; with --ceiling, the
share of this machine's read bandwidth its decode steps reached (weights read once a step)."""

from __future__ import annotations

import argparse
import statistics
import sys

from kvserve.bench import ceilings, offline, results
from kvserve.bench.stats import percentile

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=10)
    offline.add_common_args(p)
    ceilings.add_ceiling_arg(p)
    results.add_result_args(p, "histogram of the iterations' latencies")


def run(args: argparse.Namespace) -> dict:
    from kvserve import SamplingParams

    llm, load_s = offline.load_llm(args)
    prompts = offline.token_prompts(llm, args.batch_size, args.input_len, args.seed or 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    iters = [("warm-up", args.num_iters_warmup), ("measured", args.num_iters)]
    latencies, noise = [], []
    for label, n in iters:
        rng = range(n)
        if not args.disable_tqdm:
            from tqdm import tqdm

            rng = tqdm(rng, desc=f"{label} iterations", file=sys.stderr, dynamic_ncols=True)
        for _ in rng:
            outs, wall, load, _ = offline.timed_generate(llm, prompts, params)
            if label == "measured":
                latencies.append(wall)
                noise.append(load.get("foreign_cores", 0.0))
    out = {"model": str(llm.engine.config.model), "batch_size": args.batch_size,
           "input_len": args.input_len, "output_len": args.output_len, "load_s": load_s,
           "avg_latency": statistics.fmean(latencies) if latencies else float("nan"),
           "latencies": latencies,
           "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
           "output_tokens_per_s": (args.batch_size * args.output_len / statistics.median(
               latencies)) if latencies else float("nan"),
           "foreign_cores_max": max(noise, default=float("nan"))}
    print(f"Avg latency: {out['avg_latency']:.4f} seconds")
    for q, v in out["percentiles"].items():
        print(f"{q}% percentile latency: {v:.4f} seconds")
    print(f"output tokens/s at the median: {out['output_tokens_per_s']:.1f}; model loaded in "
          f"{load_s:.2f} s; other processes took up to {out['foreign_cores_max']:.2f} cores")
    if args.ceiling and latencies:  # decode steps/s, the prefill included: a lower bound
        ceilings.report(out, out["model"], step_rate=args.output_len / statistics.median(
            latencies))
    results.finish(args, out, "latency", results.plot_latencies)
    return out
