#!/usr/bin/env python
"""Offline throughput: kvserve vs Hugging Face transformers `generate`, side by side, one run.

Workloads (greedy, every request generates the full length), on the reference model
(benchmarks.lab.reference) or --model: `main`, 64 prompts x 128 random tokens -> 128 new tokens
each (transformers: one batch of 64), and `batch1`, 1 x 128 -> 128; each in float32 and
(unless --skip-bf16) bfloat16. With --prefix-len N every prompt starts with one shared N-token
prefix (kvserve's prefix cache against transformers recomputing it; `kvserve-nocache` is
kvserve with the cache off). Metric: output tokens / generate wall time (model load excluded,
one tiny warm-up first), with decode-only tok/s, prefill time and the greedy agreement.

The protocol (benchmarks.lab.harness): each measurement its own subprocess, engines alternating,
--repeats runs, a disturbed run re-run, median [min-max] and the ratio of medians. The
machine's ceilings (kvserve.bench.ceilings) are measured at the start and at the end: the
main workload's share of the fp32 matmul ceiling and of its own GEMM ceiling, batch-1
decode's share of the read bandwidth of a weight-sized buffer.

    .venv/bin/python benchmarks/bench_throughput.py                # several minutes
    .venv/bin/python benchmarks/bench_throughput.py --quick        # 16 x 32 -> 32, 1 repeat
    .venv/bin/python benchmarks/bench_throughput.py --skip-bf16 --json out.json --record
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import _repo_root  # noqa: F401  (the repo root on sys.path: benchmarks.lab)
from benchmarks.lab import harness
from kvserve.bench import ceilings
from kvserve.bench.noise import Interference
from kvserve.bench.offline import random_prompts
from kvserve.bench.record import Row, add_record_arg, current_machine, write_record
from benchmarks.lab.reference import ensure_checkpoint
from kvserve.bench.stats import fmt_spread, spread
from kvserve.kernels.cpu.cpu_features import ISA_CAPS, ISA_ENV, LIBRARY_ISA_ENV, isa_cap_env
from kvserve.kv.prefix_index import common_prefix

WORKER_SCRIPT = os.path.abspath(__file__)
ENGINES = ("kvserve", "transformers", "kvserve-nocache")


def run_worker(argv: list[str], args: argparse.Namespace) -> dict:
    """This script's worker in its own process (harness.run_worker)."""
    return harness.run_worker(argv, args.threads, args.timeout, WORKER_SCRIPT)


def worker_kvserve(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from kvserve import LLM
    from kvserve.bench.throughput import measure

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
              max_num_seqs=max(args.num_prompts, 2), block_size=16,
              enable_prefix_caching=args.engine != "kvserve-nocache",
              max_model_len=len(prompts[0]) + args.max_tokens)
    load_s = time.perf_counter() - t0
    r = measure(llm, prompts, args.max_tokens)
    r.pop("finish_times", None)
    return {"wall_s": r["elapsed_time"], "load_s": load_s, "ttft_s": r.get("ttft_median_s"),
            **r}


def worker_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import torch
    import transformers

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else model.config.pad_token_id
    gc.pad_token_id = 0 if pad is None else (pad[0] if isinstance(pad, list) else pad)
    gc.eos_token_id, gc.do_sample = None, False  # every row generates max_new_tokens
    gc.temperature = gc.top_p = gc.top_k = None

    def run(batch: list[list[int]], new: int):
        ids = torch.tensor(batch, dtype=torch.long)  # equal lengths: no padding
        with Interference() as noise, torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, min_new_tokens=new, generation_config=gc)
            wall = time.perf_counter() - t
        return wall, out[:, ids.shape[1]:].tolist(), noise.result

    run([p[:8] for p in prompts[:2]], 4)  # warm-up
    wall, tokens, noise = run(prompts, args.max_tokens)
    out = {"wall_s": wall, "first_outputs": tokens[:4], "load_s": load_s, **noise,
           "total_output_tokens": sum(map(len, tokens))}
    # prefill estimate: the same generate for one token; decode, the rest of the time
    prefill_s, _, split = run(prompts, 1)
    if split.get("foreign_cores", 0.0) < args.noise_threshold and wall > prefill_s:
        out.update(prefill_s=prefill_s, ttft_s=prefill_s,
                   decode_tok_s=sum(len(t) - 1 for t in tokens) / (wall - prefill_s))
    return out


def worker_ceiling(args: argparse.Namespace) -> dict:
    """The machine's ceilings now; the model's GEMMs at 1 row, the main workload's decode
    batch and its prefill step."""
    with Interference() as noise:
        out = {"matmul_gflops": ceilings.matmul_gflops(args.samples),
               "copy_gbps": ceilings.copy_gbps(args.samples),
               "read_gbps": ceilings.read_gbps(ceilings.weight_bytes(args.model), args.samples),
               "gemm": ceilings.gemm_seconds(args.model, [1, args.num_prompts, min(
                   args.num_prompts * args.prompt_len, 8192)], args.samples)}
    return {**out, **noise.result}


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "ceiling":
        return worker_ceiling(args)
    from kvserve.model_loader.gguf_checkpoint import is_gguf, open_gguf

    config_dir = open_gguf(args.model).dir if is_gguf(args.model) else Path(args.model)
    vocab = json.loads((Path(config_dir) / "config.json").read_text())["vocab_size"]
    prefix = random_prompts(1, args.prefix_len, vocab, args.seed + 1)[0]
    prompts = [prefix + p for p in random_prompts(args.num_prompts, args.prompt_len, vocab,
                                                  args.seed)]
    fn = worker_transformers if args.engine == "transformers" else worker_kvserve
    res = fn(args, prompts)
    n_out = res["total_output_tokens"]
    return {**res, "engine": args.engine, "dtype": args.dtype, "tok_s": n_out / res["wall_s"],
            "full_length": n_out == args.num_prompts * args.max_tokens,
            "threads": torch.get_num_threads()}


def run_all(args: argparse.Namespace, model: Path, engines: list[str], dtypes: list[str],
            shapes: dict[str, int]) -> tuple[list[dict], list[dict]]:
    """Ceilings first and last (the machine drifts), the engines alternating between."""
    common = ["--model", str(model), "--prompt-len", str(args.prompt_len), "--max-tokens",
              str(args.output_len), "--prefix-len", str(args.prefix_len), "--seed",
              str(args.seed), "--noise-threshold", str(args.noise_threshold)]
    ceiling = ["ceiling", *common, "--num-prompts", str(shapes["main"])]
    ceil = [harness.measure(lambda: run_worker(ceiling, args), args, "ceilings")]
    runs = []
    for r, eng in harness.alternate(engines, args.repeats):
        for dt in dtypes:
            for wl, n in shapes.items():
                argv = ["bench", "--engine", eng, "--dtype", dt, "--num-prompts", str(n), *common]
                res = harness.measure(lambda: run_worker(argv, args), args,
                                      f"{eng} {dt} {wl} #{r + 1}")
                runs.append({**res, "engine": eng, "dtype": dt, "workload": wl, "repeat": r})
                if "error" in res:
                    print(f"{eng} {dt} {wl} failed: {res['error']}", file=sys.stderr)
    ceil.append(harness.measure(lambda: run_worker(ceiling, args), args, "ceilings"))
    return runs, [c for c in ceil if "error" not in c]


def tabulate(args, runs: list[dict], ceil: list[dict], engines: list[str], dtypes: list[str],
             shapes: dict[str, int], model: Path) -> list[dict]:
    """One row per workload and dtype: each engine's medians, the ratios, the ceilings'
    shares (the best ceiling of the two runs: the stricter yardstick)."""
    table = []
    for dt in dtypes:
        for wl, n in shapes.items():
            ok = {e: [r for r in runs if (r["engine"], r["dtype"], r["workload"]) == (e, dt, wl)
                      and "error" not in r] for e in engines}
            row = {"workload": wl, "dtype": dt, "shape": f"{n} x {args.prefix_len or ''}"
                   f"{'+' if args.prefix_len else ''}{args.prompt_len} -> {args.output_len}"}
            for e in engines:
                row[e] = {k: spread([r[k] for r in ok[e] if r.get(k) is not None])
                          for k in ("tok_s", "wall_s", "decode_tok_s", "prefill_s")}
                row[e]["others"] = max((r.get("foreign_cores", 0.0) for r in ok[e]), default=None)
            k, hf = row["kvserve"] if "kvserve" in engines else {}, row.get("transformers")
            if k and hf and k["tok_s"] and hf["tok_s"]:
                row["ratio"] = k["tok_s"]["median"] / hf["tok_s"]["median"]
                if k["decode_tok_s"] and hf["decode_tok_s"]:
                    row["decode_ratio"] = k["decode_tok_s"]["median"] / hf["decode_tok_s"]["median"]
                row["greedy_common_prefix"] = [
                    common_prefix(a, b) for a, b in zip(ok["kvserve"][0]["first_outputs"],
                                                        ok["transformers"][0]["first_outputs"])]
            if ceil and k and k["wall_s"]:
                shares(row, k, ceil, model, args, n)
            table.append(row)
    return table


def shares(row: dict, k: dict, ceil: list[dict], model: Path, args, n: int) -> None:
    wall = k["wall_s"]["median"]
    params = ceilings.param_counts(model)
    if row["workload"] == "main":
        gflops = ceilings.workload_flops(params, n, args.prefix_len + args.prompt_len,
                                         args.output_len) / wall / 1e9
        best = max(c["matmul_gflops"].get(row["dtype"], 0.0) for c in ceil)
        k["frac_matmul_ceiling"] = gflops / best if best else None
        if row["dtype"] == "float32":
            k["frac_gemm_ceiling"] = min(ceilings.gemm_ceiling_seconds(
                c["gemm"], n, args.prefix_len + args.prompt_len, args.output_len, 8192)
                for c in ceil) / wall
    elif row["dtype"] == "float32" and k["decode_tok_s"]:
        limit = max(c["read_gbps"] for c in ceil) * 1e9 / ceilings.weight_bytes(model)
        k["frac_bandwidth_limit"] = k["decode_tok_s"]["median"] / limit


def report(table: list[dict], engines: list[str], ceil: list[dict], model: Path) -> None:
    print(f"\nmodel {model}\n{current_machine()}")
    print(f"{'workload':<22} {'dtype':<9} {'engine':<16} {'tok/s':>22} {'decode tok/s':>22} "
          f"{'prefill s':>9} {'others':>6} {'kv/hf':>6}")
    for row in table:
        for i, e in enumerate(engines):
            s = row[e]
            ratio = f"{row['ratio']:.2f}x" if i == len(engines) - 1 and "ratio" in row else ""
            pre = f"{s['prefill_s']['median']:.3f}" if s["prefill_s"] else "-"
            oth = "-" if s["others"] is None else f"{s['others']:.2f}"
            print(f"{row['shape'] if i == 0 else '':<22} {row['dtype'] if i == 0 else '':<9} "
                  f"{e:<16} {fmt_spread(s['tok_s']):>22} {fmt_spread(s['decode_tok_s']):>22} "
                  f"{pre:>9} {oth:>6} {ratio:>6}")
        k = row.get("kvserve", {})
        extra = [f"decode kv/hf {row['decode_ratio']:.2f}x" if "decode_ratio" in row else "",
                 f"greedy common prefixes {row['greedy_common_prefix']}"
                 if "greedy_common_prefix" in row else ""]
        for key, what in (("frac_matmul_ceiling", "of the matmul ceiling"),
                          ("frac_gemm_ceiling", "of its GEMM ceiling"),
                          ("frac_bandwidth_limit", "of the read-bandwidth limit")):
            if k.get(key) is not None:
                extra.append(f"kvserve {100 * k[key]:.1f}% {what}")
        if any(extra):
            print(" " * 4 + "; ".join(x for x in extra if x))
    for c in ceil:
        mm = ", ".join(f"{k} {v:.0f}" for k, v in c["matmul_gflops"].items())
        print(f"ceilings: matmul {mm} GFLOP/s, read {c['read_gbps']:.1f} GB/s, "
              f"copy {c['copy_gbps']:.1f} GB/s (others {c.get('foreign_cores', 0):.2f} cores)")
    print("transformers' decode and prefill: the same generate for one token subtracted")


def record(args: argparse.Namespace, table: list[dict], engines: list[str]) -> None:
    """Issue 18's targets: >= 1.3x transformers on the main float32 workload, >= 90% of the
    in-run GEMM ceiling there, batch-1 decode >= 70% of the read limit."""
    rows = []
    for row in table:
        k, main32 = row["kvserve"], (row["workload"], row["dtype"]) == ("main", "float32")
        hf, r = row.get("transformers", {}).get("tok_s"), row.get("ratio")
        if k["tok_s"]:
            rows.append(Row(f"{row['shape']}, {row['dtype']}", "tok/s",
                            round(k["tok_s"]["median"], 1), round(hf["median"], 1) if hf else
                            None, None if r is None else round(r, 2),
                            ">= 1.3x" if main32 else None,
                            r >= 1.3 if main32 and r is not None else None))
        for key, what, target in (("frac_gemm_ceiling", "share of the in-run GEMM ceiling", 90),
                                  ("frac_bandwidth_limit", "decode: share of the in-run read "
                                   "limit", 70)):
            if k.get(key) is not None:
                f = round(100 * k[key], 1)
                rows.append(Row(f"{row['shape']}: {what}", "%", f, None, None, f">= {target}%",
                                f >= target))
    write_record(args.record, rows=rows, title="Offline throughput against transformers, the "
                 "reference model", peer="transformers generate, in the same run"
                 if "transformers" in engines else "none: kvserve alone",
                 notes=f"Medians, {args.threads} threads; ratios of medians kvserve / "
                       "transformers.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_harness_args(p)
    p.add_argument("--quick", action="store_true", help="16 x 32 -> 32, 1 repeat")
    p.add_argument("--skip-bf16", action="store_true", help="float32 only")
    p.add_argument("--json", metavar="OUT", help="also write every run to this JSON file")
    p.add_argument("--model", help="a checkpoint directory (default: the reference model)")
    p.add_argument("--engines", default="kvserve,transformers",
                   help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--num-prompts", type=int, help="main workload (default 64)")
    p.add_argument("--prompt-len", type=int, help="default 128")
    p.add_argument("--output-len", type=int, help="default 128")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="one shared prefix of this many tokens before every prompt")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--cpu-isa", choices=["native", *ISA_CAPS],
                   help="cap every worker (kvserve's kernels, ATen, MKL, oneDNN) to this "
                        "instruction set; native: no cap")
    add_record_arg(p, "offline-throughput")
    # the worker's own flags (`--worker bench|ceiling`, started by run_worker)
    for flag, kw in (("--worker", {"choices": ["bench", "ceiling"]}), ("--engine", {}),
                     ("--dtype", {"default": "float32"}), ("--max-tokens", {"type": int}),
                     ("--samples", {"type": int, "default": 9})):
        p.add_argument(flag, help=argparse.SUPPRESS, **kw)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    for name, full, quick in (("num_prompts", 64, 16), ("prompt_len", 128, 32),
                              ("output_len", 128, 32)):  # what is given wins over --quick
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return harness.worker_output(lambda: worker(args))
    if args.cpu_isa:  # the workers inherit it
        for var in (ISA_ENV, *LIBRARY_ISA_ENV):
            os.environ.pop(var, None)
        if args.cpu_isa != "native":
            os.environ.update(isa_cap_env(args.cpu_isa))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        sys.exit(f"--engines must be a subset of {','.join(ENGINES)}")
    model = Path(args.model) if args.model else ensure_checkpoint(timeout=args.timeout)
    dtypes = ["float32"] if args.skip_bf16 else ["float32", "bfloat16"]
    shapes = {"main": args.num_prompts, "batch1": 1}
    t0 = time.time()
    runs, ceil = run_all(args, model, engines, dtypes, shapes)
    table = tabulate(args, runs, ceil, engines, dtypes, shapes, model)
    print(f"\n{(time.time() - t0) / 60:.1f} min, {args.threads} threads, {args.repeats} "
          "repeat(s), median [min-max]")
    report(table, engines, ceil, model)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "table": table, "runs": runs,
                                               "ceilings": ceil}, indent=1))
    if args.record and "kvserve" in engines:
        record(args, table, engines)
    errors = [r for r in runs if "error" in r]
    return 1 if errors and len(errors) == len(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
