"""`kvserve bench serve`: a load generator against any OpenAI-compatible server.

Requests (datasets.py) are sent at --request-rate requests per second (inf: all at once), the
gaps drawn from a gamma distribution of shape --burstiness (1: Poisson arrivals; lower: burstier;
higher: more uniform), at most --max-concurrency in flight; multi_turn conversations arrive that
way and then send their turns one after another. Reported: TTFT, TPOT, ITL and E2E latency
(--percentile-metrics) at --metric-percentiles, request and token throughput, and the prefix
cache's hit rate where the server exports kvserve's /metrics. Without --base-url / --port, a
`kvserve serve` is started on a free port (--server-model, --server-args) and stopped after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import time

import httpx

from kvserve.bench import datasets, results, spawn
from kvserve.bench.client import RequestResult, chat_body, completion_body, stream_request
from kvserve.bench.stats import parse_percentiles, pct_label, summarize
from kvserve.utils.ports import free_port

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 "
                   "(default: --host/--port when --port is given, else start `kvserve serve`)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=None)
    g.add_argument("--backend", choices=list(ENDPOINTS), default=None,
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions, each prompt "
                   "one user message (text only) (default: openai, openai-chat for multi_turn)")
    g.add_argument("--endpoint", default=None, help="the API path (default: the backend's)")
    g.add_argument("--model", default=None, help="model name in requests (default: none, the "
                   "server's default model)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--server-model", default=None, help="MODEL of the `kvserve serve` started "
                   "without --base-url (default: the embedded model)")
    g.add_argument("--server-args", default="", help="more `kvserve serve` flags, one string")
    g.add_argument("--server-log", action="store_true", help="show the started server's log")
    g.add_argument("--ready-check-timeout-sec", type=float, default=300.0)
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=200,
                   help="requests (multi_turn: conversations) (default 200)")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (multi_turn: conversations) per second (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps (1: Poisson arrivals)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no limit)")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="short requests sent before the measured load (default 1)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate the full output length (default on)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--disable-tqdm", action="store_true")
    datasets.add_dataset_args(p.add_argument_group("dataset"))
    g = p.add_argument_group("report")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help=f"comma list of {','.join(METRICS)} (default all)")
    g.add_argument("--metric-percentiles", default="50,90,99",
                   help="comma list of percentiles (default 50,90,99)")
    results.add_result_args(g, "plot of the TTFT, ITL and E2E distributions (CDFs)")


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    whose mean is 1/rate; all zero at an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = random.Random(seed + 1)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_load(url: str, args: argparse.Namespace, work: list, headers: dict[str, str],
                   chat: bool) -> tuple[list[RequestResult], float]:
    """Send the workload; the results in the order of the workload (turns in order), and the
    wall time from the first arrival to the last answer."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    total = sum(len(w.user_turns) for w in work) if args.dataset_name == "multi_turn" else len(work)
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)

    async def send(http, body) -> RequestResult:
        if sem is None:
            res = await stream_request(http, url, body, headers)
        else:
            async with sem:
                res = await stream_request(http, url, body, headers)
        if bar is not None:
            bar.update(1)
        return res

    async def one(http, req: datasets.BenchRequest) -> list[RequestResult]:
        if chat:
            text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
            body = chat_body([{"role": "user", "content": text}], req.output_len, args.model,
                             args.ignore_eos, args.temperature)
        else:
            body = completion_body(req.prompt, req.output_len, args.model, args.ignore_eos,
                                   args.temperature)
        return [await send(http, body)]

    async def conversation(http, conv: datasets.Conversation) -> list[RequestResult]:
        messages, out = [{"role": "system", "content": conv.system}], []
        for user in conv.user_turns:
            messages.append({"role": "user", "content": user})
            res = await send(http, chat_body(list(messages), conv.output_len, args.model,
                                             args.ignore_eos, args.temperature))
            out.append(res)
            if not res.ok:
                break
            messages.append({"role": "assistant", "content": res.text})
        return out

    worker = conversation if args.dataset_name == "multi_turn" else one
    gaps = arrival_gaps(len(work), args.request_rate, args.burstiness, args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        t0 = time.perf_counter()
        tasks = []
        for item, gap in zip(work, gaps):
            tasks.append(asyncio.ensure_future(worker(http, item)))
            if gap:
                await asyncio.sleep(gap)
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return [r for rs in done for r in rs], duration


def compute_metrics(res: list[RequestResult], duration: float, metrics: list[str],
                    percentiles: list[float]) -> dict:
    """vLLM's result fields: counts, throughputs, `{mean,median,std,pNN}_{metric}_ms`."""
    ok = [r for r in res if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict = {"duration": duration, "completed": len(ok), "failed": len(res) - len(ok),
                 "total_input_tokens": total_in, "total_output_tokens": total_out,
                 "request_throughput": len(ok) / duration if duration else float("nan"),
                 "output_throughput": total_out / duration if duration else float("nan"),
                 "total_token_throughput": (total_in + total_out) / duration
                 if duration else float("nan"),
                 "cached_tokens_fraction": sum(r.cached_tokens for r in ok) / total_in
                 if total_in else float("nan")}
    values = {"ttft": [r.ttft * 1e3 for r in ok],
              "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
              "itl": [x * 1e3 for r in ok for x in r.itl],
              "e2el": [r.latency * 1e3 for r in ok]}
    for m in metrics:
        for stat, v in summarize(values[m], percentiles).items():
            out[f"{stat}_{m}_ms"] = v
    return out


def per_request(res: list[RequestResult]) -> dict:
    """The recorded timings of every request, in seconds (vLLM's JSON lists)."""
    return {"input_lens": [r.prompt_tokens for r in res],
            "output_lens": [r.output_tokens for r in res],
            "cached_tokens": [r.cached_tokens for r in res],
            "ttfts": [r.ttft for r in res], "itls": [r.itl for r in res],
            "e2els": [r.latency for r in res], "errors": [r.error for r in res]}


def scrape_prefix_cache(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """kvserve's prefix-cache (queries, hits) counters from /metrics; None elsewhere."""
    try:
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
        if r.status_code != 200:
            return None
        from prometheus_client.parser import text_string_to_metric_families

        found: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                found[s.name] = found.get(s.name, 0.0) + s.value
    except Exception:  # not kvserve's /metrics: no hit rate
        return None
    q, h = "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total"
    return (found[q], found[h]) if q in found and h in found else None


def print_result(args: argparse.Namespace, out: dict, metrics: list[str],
                 percentiles: list[float]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Successful requests:", out["completed"]), ("Failed requests:", out["failed"]),
            ("Request rate configured (RPS):", args.request_rate),
            ("Maximum request concurrency:", args.max_concurrency),
            ("Benchmark duration (s):", f"{out['duration']:.2f}"),
            ("Total input tokens:", out["total_input_tokens"]),
            ("Total generated tokens:", out["total_output_tokens"]),
            ("Request throughput (req/s):", f"{out['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{out['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{out['total_token_throughput']:.2f}"),
            ("Cached prompt tokens (usage):", f"{100 * out['cached_tokens_fraction']:.1f}%")]
    if out.get("prefix_cache_hit_rate") is not None:
        rows.append(("Prefix cache hit rate (/metrics):",
                     f"{100 * out['prefix_cache_hit_rate']:.1f}%"))
    for k, v in rows:
        print(f"{k:<44}{v!s:>16}")
    for m in metrics:
        print(f"{METRICS[m]:-^60}")
        for stat in ["mean", "median"] + [pct_label(q) for q in percentiles]:
            label = f"{stat.capitalize() if stat[0] == 'm' else stat.upper()} {m.upper()} (ms):"
            print(f"{label:<44}{out[f'{stat}_{m}_ms']:>16.2f}")
    print("=" * 60)
    errors = [e for e in out["errors"] if e]
    if errors:
        print(f"first errors: {errors[:3]}")


def _warm_up(url: str, args: argparse.Namespace, headers: dict[str, str], chat: bool) -> None:
    for _ in range(args.num_warmups):
        body = (chat_body([{"role": "user", "content": "hello"}], 2, args.model, False)
                if chat else completion_body("hello", 2, args.model, False))
        res = asyncio.run(_one(url, body, headers, args.timeout))
        if not res.ok:
            raise RuntimeError(f"the warm-up request failed: {res.error}")


async def _one(url: str, body: dict, headers: dict[str, str], timeout: float) -> RequestResult:
    async with httpx.AsyncClient(timeout=timeout) as http:
        return await stream_request(http, url, body, headers)


def bench_url(url: str, args: argparse.Namespace) -> dict:
    """Run the benchmark against the server at `url`; the result (vLLM's fields and the
    per-request timings)."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(metrics) - set(METRICS):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}")
    percentiles = parse_percentiles(args.metric_percentiles)
    backend = args.backend or ("openai-chat" if args.dataset_name == "multi_turn" else "openai")
    if args.dataset_name == "multi_turn" and backend != "openai-chat":
        raise ValueError("multi_turn sends chats: --backend openai-chat")
    chat = backend == "openai-chat"
    endpoint = url.rstrip("/") + (args.endpoint or ENDPOINTS[backend])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    work = datasets.build(args)
    _warm_up(endpoint, args, headers, chat)
    before = scrape_prefix_cache(url, headers)
    res, duration = asyncio.run(run_load(endpoint, args, work, headers, chat))
    after = scrape_prefix_cache(url, headers)
    out = {"backend": backend, "base_url": url, "endpoint": endpoint, "model": args.model,
           "dataset_name": args.dataset_name, "prompt_format": args.prompt_format,
           "num_prompts": args.num_prompts, "request_rate": args.request_rate,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
           **compute_metrics(res, duration, metrics, percentiles), **per_request(res)}
    if before and after and after[0] > before[0]:
        out["prefix_cache_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
    print_result(args, out, metrics, percentiles)
    return out


def run(args: argparse.Namespace) -> dict:
    """`kvserve bench serve`: against --base-url / --host:--port, or a `kvserve serve` it
    starts and stops."""
    if args.base_url or args.port is not None:
        out = bench_url(args.base_url or f"http://{args.host}:{args.port}", args)
    else:
        port = free_port()
        cmd = spawn.kvserve_command(port, args.server_model, shlex.split(args.server_args))
        log = sys.stderr if args.server_log else None
        with spawn.server(cmd, port, args.ready_check_timeout_sec, log) as (url, _):
            out = bench_url(url, args)
    results.finish(args, out, "serve", results.plot_serve)
    return out
