#!/usr/bin/env python
"""`kvserve serve` against `llama-server` on one GGUF file under a chat load, one client
driving both (issue 48, item 4).

The load: --users users, each a closed loop of --turns chat turns behind one shared system
prompt of about --system-tokens tokens (the same text for everyone, as a product's system prompt
is); every turn sends the whole conversation so far (system, earlier user messages and the
answers the server gave) plus a new user message of about --user-tokens tokens, streams
--output-len tokens back (greedy, ignore_eos) and sends the next turn as soon as the answer
ends. Users arrive as a Poisson process of --arrival-rate users/s, so both servers see the same
ramp and then stay busy. The client is `kvserve bench serve --dataset-name multi_turn`
(kvserve/bench/).

Reported for each server: time to first token p50/p99, inter-token latency (gaps between
streamed chunks) p50/p99, output throughput (output tokens / wall time of the whole load),
failures, and the server's peak RSS (VmHWM). llama-server runs once per --parallel setting
(its slots, with a unified KV cache of slots x --slot-ctx tokens, its prompt cache in host
memory and `--cache-reuse`), the setting that serves best (highest output throughput) is named,
and the ratios are taken against it. Engines alternate when --repeats > 1; medians are printed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serve_llamacpp.py \\
        --llama-src /tmp/llsrc/llama_cpp_python-0.3.36 --shape llama-3.2-1b --type Q4_K_M
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serve_llamacpp.py --gguf FILE.gguf \\
        --llama-bin DIR/build/bin --parallel 4,16 --users 8 --turns 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import _repo_root  # noqa: F401  (the repo root on sys.path: benchmarks.lab)
from benchmarks.lab import gguf_models, harness, llamacpp
from kvserve.bench import serve, spawn
from kvserve.bench.record import Row, add_record_arg, current_machine, ratio, write_record
from kvserve.utils.ports import free_port


def server_cmd(args: argparse.Namespace, engine: str, parallel: int, port: int) -> list[str]:
    ctx = args.slot_ctx
    if engine == "kvserve":
        return spawn.kvserve_command(port, str(args.gguf), [
            "--num-threads", str(args.threads), "--max-model-len", str(ctx),
            "--max-num-seqs", str(args.users), "--disable-log-stats",
            *shlex.split(args.kvserve_args)])
    return [str(args.llama_bin / "llama-server"), "-m", str(args.gguf), "--port", str(port),
            "-t", str(args.threads), "-np", str(parallel), "-kvu", "-c", str(parallel * ctx),
            "--cache-reuse", str(args.cache_reuse), *shlex.split(args.llama_args)]


def load_args(args: argparse.Namespace) -> argparse.Namespace:
    """This script's load as `kvserve bench serve` flags: multi_turn chats."""
    p = argparse.ArgumentParser()
    serve.add_serve_args(p)
    return p.parse_args([
        "--dataset-name", "multi_turn", "--num-prompts", str(args.users),
        "--multi-turn-turns", str(args.turns), "--multi-turn-system-len",
        str(args.system_tokens), "--multi-turn-user-len", str(args.user_tokens),
        "--multi-turn-output-len", str(args.output_len), "--request-rate",
        str(args.arrival_rate), "--seed", str(args.seed), "--timeout", str(args.timeout),
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--disable-tqdm"])


def run_server(args: argparse.Namespace, engine: str, parallel: int = 0) -> dict:
    """Start one server, drive the load through `kvserve bench serve`, stop it."""
    port = free_port()
    log = sys.stderr if args.server_log else None
    with spawn.server(server_cmd(args, engine, parallel, port), port, args.timeout, log,
                      env={"OMP_NUM_THREADS": str(args.threads)}) as (url, proc):
        out = serve.bench_url(url, load_args(args))
        rss = spawn.peak_rss_mb(proc.pid)
    res = {"output_tok_s": out["output_throughput"], "ttft_p50_ms": out["p50_ttft_ms"],
           "ttft_p99_ms": out["p99_ttft_ms"], "itl_p50_ms": out["p50_itl_ms"],
           "itl_p99_ms": out["p99_itl_ms"], "peak_rss_mb": rss, "duration_s": out["duration"],
           "turns_failed": args.users * args.turns - out["completed"],
           "cached_fraction": out["cached_tokens_fraction"],
           "errors": [e for e in out["errors"] if e][:3]}
    res["engine"] = engine if engine == "kvserve" else f"llama-server -np {parallel}"
    print(f"  {res['engine']}: {json.dumps({k: v for k, v in res.items() if k != 'engine'})}",
          flush=True)
    return res


KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "peak_rss_mb",
        "duration_s", "turns_failed")


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in KEYS}


# Issue 48's item 4: TTFT p50 <= 0.5x, output throughput >= 1.5x, inter-token p99 no worse;
# per figure (unit, target, whether a ratio meets it)
TARGETS = {"output_tok_s": ("tok/s", ">= 1.5x", lambda r: r >= 1.5),
           "ttft_p50_ms": ("ms", "<= 0.5x", lambda r: r <= 0.5),
           "ttft_p99_ms": ("ms", None, None), "itl_p50_ms": ("ms", None, None),
           "itl_p99_ms": ("ms", "<= 1x", lambda r: r <= 1.0),
           "peak_rss_mb": ("MB", None, None)}


def record(args: argparse.Namespace, kv: dict, ll: dict, best: str) -> None:
    """The figures page's record: kvserve against llama-server's best --parallel setting."""
    rows = []
    for key, (unit, target, met) in TARGETS.items():
        r = ratio(kv[key], ll[key])
        rows.append(Row(key, unit, round(kv[key], 1), round(ll[key], 1), r, target,
                        None if met is None or r is None else met(r)))
    write_record(args.record, name=f"serve-llamacpp-{args.gguf.stem}", rows=rows,
                 title=f"kvserve serve against llama-server ({best}), {args.gguf.name}: "
                 f"{args.users} users x {args.turns} turns behind a shared system prompt",
                 peer=f"llama-server at its best --parallel setting ({best}, "
                 f"--cache-reuse {args.cache_reuse}), the same file and threads",
                 notes=f"medians of {args.repeats}; system ~{args.system_tokens} tokens, "
                 f"user ~{args.user_tokens}, {args.output_len} out, {args.arrival_rate} users/s.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path,
                   help="the file (default: benchmarks.lab.gguf_models' --shape/--type)")
    p.add_argument("--llama-src", type=Path,
                   help="llama.cpp source tree (benchmarks.lab.gguf_models')")
    p.add_argument("--llama-bin", type=Path, help="llama.cpp build/bin (default: --llama-src's)")
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--type", default="Q4_K_M")
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--arrival-rate", type=float, default=2.0, help="users per second")
    p.add_argument("--parallel", default="1,2,4,8",
                   help="llama-server --parallel settings (\"\": kvserve alone)")
    p.add_argument("--cache-reuse", type=int, default=256)
    p.add_argument("--slot-ctx", type=int, default=2048, help="context per conversation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags")
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--server-log", action="store_true")
    p.add_argument("--json", type=Path)
    add_record_arg(p, "serving")
    args = p.parse_args()
    if args.gguf is None or args.llama_bin is None:
        if args.llama_src is None:
            p.error("give --llama-src, or --gguf and --llama-bin")
        args.llama_bin = args.llama_bin or llamacpp.bin_dir(args.llama_src)
        if args.gguf is None:
            args.gguf = gguf_models.ensure(args.llama_src, args.shape, [args.type])[args.type]
    print(current_machine())
    print(f"{args.gguf}: {args.users} users x {args.turns} turns, system ~{args.system_tokens}, "
          f"user ~{args.user_tokens}, {args.output_len} out, {args.arrival_rate} users/s")
    settings = [int(x) for x in args.parallel.split(",") if x]  # "": kvserve alone
    runs: dict[str, list[dict]] = {}
    for _, engine in harness.alternate(["kvserve", *map(str, settings)], args.repeats):
        ours = engine == "kvserve"
        res = run_server(args, "kvserve" if ours else "llama", 0 if ours else int(engine))
        runs.setdefault(res["engine"], []).append(res)
    table = {name: medians(rs) for name, rs in runs.items()}
    print(f"\n{'server':<24}" + "".join(f"{k:>14}" for k in KEYS))
    for name, row in table.items():
        print(f"{name:<24}" + "".join(f"{row[k]:>14.1f}" for k in KEYS))
    llama = {k: v for k, v in table.items() if k != "kvserve"}
    best = max(llama, key=lambda k: llama[k]["output_tok_s"]) if llama else None
    if best:
        kv, ll = table["kvserve"], table[best]
        print(f"best llama-server setting: {best}")
        print(f"kvserve / {best}: output throughput "
              f"{kv['output_tok_s'] / ll['output_tok_s']:.2f}x, "
              f"TTFT p50 {kv['ttft_p50_ms'] / ll['ttft_p50_ms']:.2f}x, "
              f"TTFT p99 {kv['ttft_p99_ms'] / ll['ttft_p99_ms']:.2f}x, "
              f"ITL p99 {kv['itl_p99_ms'] / ll['itl_p99_ms']:.2f}x")
    if args.record and best:
        record(args, table["kvserve"], table[best], best)
    if args.json:
        args.json.write_text(json.dumps({"cpu": current_machine(), "gguf": str(args.gguf),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": table, "best": best, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
