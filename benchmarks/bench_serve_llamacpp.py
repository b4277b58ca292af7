#!/usr/bin/env python
"""`kvserve serve` against `llama-server` on one GGUF file under a chat load, one client
driving both (issue 48, item 4).

The load: --users users, each a closed loop of --turns chat turns behind one shared system
prompt of about --system-tokens tokens (the same text for everyone, as a product's system prompt
is); every turn sends the whole conversation so far (system, earlier user messages and the
answers the server gave) plus a new user message of about --user-tokens tokens, streams
--output-len tokens back (greedy, ignore_eos) and sends the next turn as soon as the answer
ends. Users arrive as a Poisson process of --arrival-rate users/s, so both servers see the same
ramp and then stay busy.

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
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import make_gguf_models  # noqa: E402
from bench_serving import pct  # noqa: E402

# Short common words: about one token each in byte-level BPE vocabularies.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there one all we their can has been if more "
         "when will would who so no time out up into could new than some these two may first "
         "then do any like my now over such our man me even most made after also did many off "
         "before must well back through years much where your way down should because each just "
         "those people how too little state good very make world still own see men work long "
         "here get both between life being under never day same another know while last might "
         "us great old year come since against go came right used take three").split()


@dataclass
class Turn:
    """One streamed answer as the client saw it."""
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # what the server's usage says it reused


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_turn(http: httpx.AsyncClient, url: str, messages: list[dict],
                   output_len: int) -> tuple[Turn, str]:
    body = {"messages": messages, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    turn, text, chunks = Turn(), [], 0
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return turn, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    turn.error = str(chunk["error"])[:200]
                    return turn, ""
                delta = "".join((c.get("delta") or {}).get("content") or ""
                                for c in chunk.get("choices") or [])
                if delta:
                    now = time.perf_counter()
                    if not turn.ttft:
                        turn.ttft = now - start
                    else:
                        turn.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(delta)
                if chunk.get("usage"):
                    turn.output_tokens = chunk["usage"]["completion_tokens"]
                    turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    turn.cached_tokens = (chunk["usage"].get("prompt_tokens_details")
                                          or {}).get("cached_tokens") or 0
        turn.output_tokens = turn.output_tokens or chunks
        turn.ok = turn.ttft > 0
    except Exception as exc:  # counted as a failure; the load goes on
        turn.error = f"{type(exc).__name__}: {exc}"
    return turn, "".join(text)


async def warm_up(url: str, timeout: float) -> None:
    async with httpx.AsyncClient(timeout=timeout) as http:
        turn, _ = await one_turn(http, url, [{"role": "user", "content": "hello"}], 4)
    if not turn.ok:
        raise RuntimeError(f"warm-up failed: {turn.error}")


async def user(http: httpx.AsyncClient, url: str, args: argparse.Namespace, system: str,
               uid: int, delay: float) -> list[Turn]:
    await asyncio.sleep(delay)
    rng = random.Random(args.seed * 1000 + uid)
    messages = [{"role": "system", "content": system}]
    turns = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.user_tokens)})
        turn, answer = await one_turn(http, url, messages, args.output_len)
        turns.append(turn)
        if not turn.ok:
            break
        messages.append({"role": "assistant", "content": answer})
    return turns


async def drive(url: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    rng = random.Random(args.seed)
    system = words(random.Random(args.seed - 1), args.system_tokens)
    delays, t = [], 0.0
    for _ in range(args.users):
        delays.append(t)
        t += rng.expovariate(args.arrival_rate) if args.arrival_rate != float("inf") else 0.0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(http, url, args, system, i, d)
                                          for i, d in enumerate(delays)))
        return [t for ts in per_user for t in ts], time.perf_counter() - t0


def summarize(turns: list[Turn], duration: float, expected: int) -> dict:
    ok = [t for t in turns if t.ok]
    ttft = [t.ttft * 1000 for t in ok]
    itl = [x * 1000 for t in ok for x in t.itl]
    out = sum(t.output_tokens for t in ok)
    prompt = sum(t.prompt_tokens for t in ok)
    return {"turns_ok": len(ok), "turns_failed": expected - len(ok), "duration_s": duration,
            "output_tok_s": out / duration, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "first_prompt_tokens": next((t.prompt_tokens for t in ok if t.prompt_tokens), 0),
            "prompt_tokens": prompt,
            "cached_fraction": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
            "errors": [t.error for t in turns if not t.ok][:3]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s")


def server_cmd(args: argparse.Namespace, engine: str, parallel: int, port: int) -> list[str]:
    ctx = args.slot_ctx
    if engine == "kvserve":
        return [sys.executable, "-m", "kvserve.cli", "serve", str(args.gguf), "--port",
                str(port), "--num-threads", str(args.threads), "--max-model-len", str(ctx),
                "--max-num-seqs", str(args.users), "--disable-log-stats",
                *args.kvserve_args.split()]
    return [str(args.llama_bin / "llama-server"), "-m", str(args.gguf), "--port", str(port),
            "-t", str(args.threads), "-np", str(parallel), "-kvu", "-c", str(parallel * ctx),
            "--cache-reuse", str(args.cache_reuse), *args.llama_args.split()]


def run_server(args: argparse.Namespace, engine: str, parallel: int = 0) -> dict:
    """Start one server, warm it with one short chat, drive the load, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = server_cmd(args, engine, parallel, port)
    print(f"  starting: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=sys.stderr if args.server_log else subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, args.timeout)
        asyncio.run(warm_up(url, args.timeout))
        turns, duration = asyncio.run(drive(url, args))
        res = summarize(turns, duration, args.users * args.turns)
        res["peak_rss_mb"] = peak_rss_mb(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    res["engine"] = engine if engine == "kvserve" else f"llama-server -np {parallel}"
    print(f"  {res['engine']}: {json.dumps({k: v for k, v in res.items() if k != 'engine'})}",
          flush=True)
    return res


KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "peak_rss_mb",
        "duration_s", "turns_failed")


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in KEYS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="the file (default: make_gguf_models' --shape/--type)")
    p.add_argument("--llama-src", type=Path, help="llama.cpp source tree (make_gguf_models')")
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
    args = p.parse_args()
    if args.gguf is None or args.llama_bin is None:
        if args.llama_src is None:
            p.error("give --llama-src, or --gguf and --llama-bin")
        tree = make_gguf_models.llama_tree(args.llama_src)
        args.llama_bin = args.llama_bin or tree / "build" / "bin"
        if args.gguf is None:
            args.gguf = make_gguf_models.ensure(args.llama_src, args.shape, [args.type])[args.type]
    from kvserve.kernels.cpu.cpu_features import cpu_info

    info = cpu_info()
    print(f"CPU: {info.summary()}")
    print("flags: " + " ".join(sorted(f for f in info.flags if f.startswith(("avx", "fma")))))
    print(f"{args.gguf}: {args.users} users x {args.turns} turns, system ~{args.system_tokens}, "
          f"user ~{args.user_tokens}, {args.output_len} out, {args.arrival_rate} users/s")
    settings = [int(x) for x in args.parallel.split(",") if x]  # "": kvserve alone
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        order = [("kvserve", 0)] + [("llama", n) for n in settings]
        for engine, n in (order if r % 2 == 0 else order[::-1]):
            res = run_server(args, engine, n)
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
    if args.json:
        args.json.write_text(json.dumps({"cpu": info.summary(), "gguf": str(args.gguf),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": table, "best": best, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
