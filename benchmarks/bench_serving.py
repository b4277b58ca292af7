"""Serving benchmark: a shared-prefix workload sent to the OpenAI-compatible server at a set
request rate (Poisson arrivals), measuring what clients see.

    python benchmarks/bench_serving.py                       # starts its own server (default model)
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 20

Each request is `prefix + suffix` as token ids (so lengths are exact, whatever the tokenizer):
one of `--num-prefixes` shared prefixes of `--prefix-len` tokens, then `--suffix-len` random
tokens; it asks for exactly `--output-len` tokens (ignore_eos) and streams them back.

Reported: TTFT, TPOT (per request: (end - first token) / (tokens - 1)) and inter-token latency
(gaps between streamed chunks) as mean/p50/p95/p99, end-to-end latency, request and token
throughput, and the prefix-cache hit rate from the server's /metrics before and after the run
(plus the cached prompt tokens that the responses' usage reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def build_workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo, hi = args.min_token_id, args.max_token_id
    prefixes = [[rng.randrange(lo, hi) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    return [prefixes[i % args.num_prefixes] + [rng.randrange(lo, hi)
                                               for _ in range(args.suffix_len)]
            for i in range(args.num_prompts)]


async def send_one(http: httpx.AsyncClient, url: str, model: str | None, prompt: list[int],
                   output_len: int, headers: dict[str, str]) -> Result:
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res = Result(start=time.perf_counter())
    last = res.start
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body,
                               headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if not res.ttft:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.output_tokens = u["completion_tokens"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
        res.latency = time.perf_counter() - res.start
        res.ok = res.ttft > 0
    except Exception as exc:  # count it, keep going
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def scrape(url: str, headers: dict[str, str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def run(args: argparse.Namespace, url: str) -> tuple[list[Result], float]:
    prompts = build_workload(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(http, prompt):
        if sem is None:
            return await send_one(http, url, args.model, prompt, args.output_len, headers)
        async with sem:
            return await send_one(http, url, args.model, prompt, args.output_len, headers)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        tasks = []
        t0 = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(http, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    f = int(k)
    c = min(f + 1, len(v) - 1)
    return v[f] + (v[c] - v[f]) * (k - f)


def report(args, results: list[Result], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok
            if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2e = [r.latency * 1000 for r in ok]
    dq = after.get("kvserve:prefix_cache_queries_total", 0) - \
        before.get("kvserve:prefix_cache_queries_total", 0)
    dh = after.get("kvserve:prefix_cache_hits_total", 0) - \
        before.get("kvserve:prefix_cache_hits_total", 0)
    summary = {
        "num_prompts": len(results), "successful": len(ok), "failed": len(failed),
        "request_rate": args.request_rate, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "output_len": args.output_len,
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prefix_cache_hit_rate": dh / dq if dq else float("nan"),
        "usage_cached_fraction": (sum(r.cached_tokens for r in ok) / in_tokens
                                  if in_tokens else float("nan")),
        "prefix_cache_queries": dq, "prefix_cache_hits": dh,
    }
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        summary[name] = {"mean": sum(vals) / len(vals) if vals else float("nan"),
                         "p50": pct(vals, 50), "p95": pct(vals, 95), "p99": pct(vals, 99)}
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [("Successful requests:", len(ok)), ("Failed requests:", len(failed)),
            ("Request rate (req/s):", args.request_rate),
            ("Prompt tokens (prefix + suffix):", f"{args.prefix_len} + {args.suffix_len}"),
            ("Output tokens per request:", args.output_len),
            ("Benchmark duration (s):", f"{duration:.2f}"),
            ("Total input tokens:", in_tokens), ("Total generated tokens:", out_tokens),
            ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
            ("Prefix cache hit rate (/metrics):", f"{100 * summary['prefix_cache_hit_rate']:.2f}%"),
            ("Cached prompt tokens (usage):", f"{100 * summary['usage_cached_fraction']:.2f}%")]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    sections = (("Time to First Token", "ttft_ms"), ("Time per Output Token (excl. 1st)",
                                                     "tpot_ms"),
                ("Inter-token Latency", "itl_ms"), ("End-to-end Latency", "e2e_ms"))
    for title, key in sections:
        print(f"{title:-^50}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "p50", "p95", "p99"):
            label = f"{'Mean' if stat == 'mean' else stat.upper()} {short} (ms):"
            print(f"{label:<40}{summary[key][stat]:>10.2f}")
    print(line)
    if failed:
        print(f"first errors: {[r.error for r in failed[:3]]}")
    return summary


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port)]
    if args.server_model:
        cmd.append(args.server_model)
    cmd += args.server_args.split() if args.server_args else []
    print(f"starting: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=sys.stderr if args.server_log else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None,
                   help="a running server (default: start one with --server-model/--server-args)")
    p.add_argument("--model", default=None, help="model name in requests (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-model", default=None,
                   help="checkpoint for the server this script starts (default: embedded model)")
    p.add_argument("--server-args", default="", help="extra `kvserve serve` flags, one string")
    p.add_argument("--server-log", action="store_true", help="show the started server's log")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-token-id", type=int, default=10)
    p.add_argument("--max-token-id", type=int, default=2000,
                   help="random prompt tokens are drawn below this (keep it under the vocab size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--result-json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")

    proc = None
    url = args.base_url.rstrip("/") if args.base_url else None
    if url is None:
        proc, url = start_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        if args.warmup:  # first-call costs (allocations, lazy imports) stay out of the figures
            body = {"prompt": [args.min_token_id] * 4, "max_tokens": 2}
            if args.model:
                body["model"] = args.model
            httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                       timeout=args.timeout).raise_for_status()
        before = scrape(url, headers)
        results, duration = asyncio.run(run(args, url))
        after = scrape(url, headers)
        summary = report(args, results, duration, before, after)
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
