"""The gateway on loopback: N `kvserve serve` replicas + `kvserve route`, a multi-tenant
shared-prefix trace (the simulator's gsp generator) replayed at its timestamps through each
routing policy, next to the simulator's prediction for the same trace.

    python benchmarks/bench_route.py                       # 4 replicas, a small gsp trace
    python benchmarks/bench_route.py --trace t.jsonl   # a trace written by `kvserve simulate
                                                       #   --generator gsp --write-trace t.jsonl`

Runs, in order, on the same replica processes (prefix caches reset between runs):
1. `alone`: replica 0 without the gateway (the single-replica hit rate; overhead baseline);
2. `gw+1`: the gateway in front of replica 0 alone (the gateway's own overhead);
3. one run per policy over all replicas;
4. `failover`: cache_aware with the busiest replica (most requests in flight) killed halfway
   through the trace.

Per run: prefix-cache hit rate (the replicas' own /metrics counters, tokens), TTFT p50/p99,
throughput, failed requests split into those that had not started streaming (must be 0) and
streams cut mid-way, and per-replica request counts. The simulator replays the same trace with
the replicas' pool size, timed lifetimes calibrated from the `alone` run (its TPOT p50 and its
prefill rate), and the same policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvserve.bench import spawn
from kvserve.bench.client import RequestResult, completion_body, stream_request
from kvserve.bench.record import Row, add_record_arg, ratio, write_record
from kvserve.bench.stats import percentile as pct
from kvserve.utils.ports import free_port
from kvserve.sim.trace import Trace, load_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent  # the replicas import this checkout's kvserve

POLICIES = ("round_robin", "least_loaded", "consistent_hash", "cache_aware")


class Proc:
    """A `kvserve` process (a replica or the gateway) on a free port, its output in a log."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, threads: int = 1) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *argv,
                                      "--port", str(self.port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        try:
            spawn.wait_healthy(self.proc, self.url, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: {e}\n{self.log_path.read_text()[-2000:]}") from None

    def pool_tokens(self) -> int:
        m = re.search(r"KV cache size: ([\d,]+) tokens", self.log_path.read_text())
        assert m, "no KV cache size line in the replica's log"
        return int(m.group(1).replace(",", ""))

    def stop(self, kill: bool = False) -> None:
        """SIGINT to its process group (SIGKILL after 15 s); `kill`: SIGKILL at once."""
        if kill and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        spawn.stop(self.proc, grace=15)
        self._log.close()


def send(http: httpx.AsyncClient, url: str, prompt: list[int], output_len: int):
    """One streamed completion (greedy, ignore_eos) through `kvserve bench serve`'s client."""
    return stream_request(http, url + "/v1/completions",
                          completion_body(prompt, output_len, None, ignore_eos=True))


def started(r: RequestResult) -> bool:
    """A first token reached the client (a stream cut later still started)."""
    return r.ttft > 0


def replica(r: RequestResult) -> str:
    return r.headers.get("x-kvserve-replica") or "-"


def scrape(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache (queries, hits) in tokens, summed over replicas."""
    q = h = 0.0
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            continue  # a killed replica: its counts are lost with it (see the failover run)
        for line in text.splitlines():
            if line.startswith("kvserve:prefix_cache_queries_total"):
                q += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvserve:prefix_cache_hits_total"):
                h += float(line.rsplit(" ", 1)[1])
    return q, h


async def replay(trace: Trace, url: str, on_half=None, burst: bool = False
                 ) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as http:
        t0 = time.perf_counter()
        tasks = []
        half = len(trace.requests) // 2
        base = trace.requests[0].timestamp or 0.0
        for i, rec in enumerate(trace.requests):
            delay = (rec.timestamp or 0.0) - base - (time.perf_counter() - t0)
            if delay > 0 and not burst:
                await asyncio.sleep(delay)
            if i == half and on_half is not None:
                on_half()
            tasks.append(asyncio.ensure_future(send(http, url, trace.prompt_tokens(rec),
                                                    rec.output_length)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(name: str, results: list[RequestResult], duration: float, before, after,
              lost_counts: bool = False) -> dict:
    ok = [r for r in results if r.ok]
    dq, dh = after[0] - before[0], after[1] - before[1]
    ttft = [r.ttft * 1000 for r in ok if started(r)]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok
            if r.output_tokens > 1]
    per: dict[str, int] = {}
    for r in ok:
        per[replica(r)] = per.get(replica(r), 0) + 1
    in_tok = sum(r.prompt_tokens for r in ok)
    return dict(run=name, requests=len(results), ok=len(ok),
                failed_not_started=sum(1 for r in results if not r.ok and not started(r)),
                cut_mid_stream=sum(1 for r in results if not r.ok and started(r)),
                hit_rate=dh / dq if dq else float("nan"),
                usage_hit_rate=sum(r.cached_tokens for r in ok) / in_tok if in_tok else 0.0,
                hit_rate_source="usage" if lost_counts else "metrics",
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99),
                tpot_p50_ms=pct(tpot, 50), duration_s=duration,
                req_per_s=len(ok) / duration,
                out_tok_per_s=sum(r.output_tokens for r in ok) / duration,
                per_replica=dict(sorted(per.items())),
                errors=sorted({r.error[:80] for r in results if not r.ok})[:3])


def prefill_rate(results: list[RequestResult]) -> float:
    """Uncached prompt tokens per second of TTFT, median over the requests that hit nothing."""
    rates = [(r.prompt_tokens - r.cached_tokens) / r.ttft for r in results
             if r.ok and started(r) and r.cached_tokens == 0]
    return pct(rates, 50) if rates else 10_000.0


def simulate(trace: Trace, replicas: int, routing: str, capacity: int, decode_ms: float,
             prefill_tps: float, balance: float, slack: int, key_tokens: int) -> float:
    from kvserve.sim.replay import SimConfig, replay as sim_replay

    cfg = SimConfig(capacity_tokens=capacity, block_size=16, replicas=replicas,
                    routing=routing, lifetime="timed", decode_ms_per_token=decode_ms,
                    prefill_tokens_per_s=prefill_tps, balance_factor=balance,
                    balance_slack=slack, spread=True,
                    hash_key_tokens=key_tokens)
    return sim_replay(trace, cfg)["hit_rate"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None, help="a JSONL trace with timestamps and token ids")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--num-groups", type=int, default=12)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-prompt-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s of the generated trace")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--balance-factor", type=float, default=1.25)
    ap.add_argument("--balance-slack", type=int, default=4)
    ap.add_argument("--hash-key-tokens", type=int, default=256)
    ap.add_argument("--no-failover", action="store_true")
    ap.add_argument("--burst", action="store_true",
                    help="also send the trace all at once to replica 0 alone and through the "
                    "gateway (the gateway's effect on peak throughput)")
    ap.add_argument("--out-dir", default="out/bench_route")
    ap.add_argument("--json", default=None, help="write the results here")
    add_record_arg(ap, "routing")
    args = ap.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        trace = load_trace(args.trace)
    else:
        from kvserve.sim.generators import gsp

        trace = gsp(num_groups=args.num_groups, prompts_per_group=args.prompts_per_group,
                    system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                    output_len=args.output_len, vocab=2048, seed=0, rate=args.rate)
        write_trace(trace, out / "gsp.jsonl")
        trace = load_trace(out / "gsp.jsonl")  # exactly what a user replays
    print(f"trace: {len(trace.requests)} requests over "
          f"{trace.requests[-1].timestamp - trace.requests[0].timestamp:.1f} s", flush=True)

    serve = ["serve", "--max-model-len", str(args.max_model_len), "--num-threads", "1",
             "--max-num-seqs", str(args.max_num_seqs), "--disable-log-stats",
             # loopback replicas the benchmark owns: the gateway reads their KV events and the
             # runs reset their caches, both admin routes (a keyless server has no admin else)
             "--allow-unauthenticated-admin"]
    reps = [Proc(f"replica{i}", serve, out) for i in range(args.replicas)]
    procs = list(reps)
    runs: list[dict] = []
    try:
        for r in reps:
            r.wait_ready()
        capacity = reps[0].pool_tokens()
        urls = [r.url for r in reps]

        def reset() -> None:
            for u in urls:
                httpx.post(u + "/reset_prefix_cache", timeout=30).raise_for_status()

        async def warm() -> None:  # first forwards of each replica are slow (allocations)
            async with httpx.AsyncClient(timeout=120) as http:
                await asyncio.gather(*(send(http, u, [5 + i] * 40, 4) for u in urls
                                       for i in range(3)))
        asyncio.run(warm())

        def run(name: str, url: str, rep_urls: list[str], on_half=None,
                burst: bool = False) -> dict:
            reset()
            before = scrape(rep_urls)
            results, duration = asyncio.run(replay(trace, url, on_half, burst))
            after = scrape(rep_urls)
            s = summarize(name, results, duration, before, after, lost_counts=on_half is not None)
            s["prefill_tps"] = prefill_rate(results)
            if on_half is not None:  # the killed replica's counters died with it
                s["hit_rate"] = s["usage_hit_rate"]
            runs.append(s)
            print(json.dumps({k: v for k, v in s.items() if k != "errors"}), flush=True)
            return s

        def gateway(name: str, policy: str, rep_urls: list[str]) -> Proc:
            argv = ["route", "--policy", policy, "--balance-factor", str(args.balance_factor),
                    "--balance-slack", str(args.balance_slack),
                    "--hash-key-tokens", str(args.hash_key_tokens), "--health-interval", "0.5"]
            for u in rep_urls:
                argv += ["--replica", u]
            g = Proc(name, argv, out)
            procs.append(g)
            g.wait_ready()
            return g

        alone = run("alone", urls[0], urls[:1])
        g = gateway("gw1", "round_robin", urls[:1])
        run("gw+1", g.url, urls[:1])
        if args.burst:  # the same requests all at once: the most each setup can serve
            run("gw+1 burst", g.url, urls[:1], burst=True)
            run("alone burst", urls[0], urls[:1], burst=True)
        g.stop()
        for policy in args.policies.split(","):
            g = gateway(f"gw-{policy}", policy, urls)
            run(policy, g.url, urls)
            g.stop()
        if not args.no_failover:
            g = gateway("gw-failover", "cache_aware", urls)

            killed: dict = {}

            def kill_busiest() -> None:
                state = httpx.get(g.url + "/replicas", timeout=10).json()["replicas"]
                victim = max(state, key=lambda r: (r["in_flight"], -r["index"]))["index"]
                killed.update(replica=victim, in_flight=state[victim]["in_flight"])
                print(f"killing replica {victim} with {state[victim]['in_flight']} requests "
                      "in flight", flush=True)
                reps[victim].stop(kill=True)

            s = run("failover", g.url, urls, on_half=kill_busiest)
            metrics = httpx.get(g.url + "/metrics", timeout=10).text
            s["killed"] = killed
            s["gateway_retries"] = sum(float(line.rsplit(" ", 1)[1])
                                       for line in metrics.splitlines()
                                       if line.startswith("kvserve:router_retries_total"))
            s["gateway_errors"] = [line for line in metrics.splitlines()
                                   if line.startswith("kvserve:router_errors_total")]
            g.stop()
    finally:
        for p in procs:
            p.stop()

    decode_ms, prefill_tps = alone["tpot_p50_ms"], alone["prefill_tps"]
    print(f"\nsimulator calibration: pool {capacity:,} tokens per replica, decode "
          f"{decode_ms:.1f} ms/token, prefill {prefill_tps:,.0f} tokens/s (from the alone run)")
    for s in runs:
        if s["run"].endswith("burst"):
            s["simulated_hit_rate"] = s["simulated_hit_rate_run_cal"] = float("nan")
            continue  # no timing model for a burst
        n, policy = {"alone": (1, "round_robin"), "gw+1": (1, "round_robin"),
                     "failover": (args.replicas, "cache_aware")}.get(
            s["run"], (args.replicas, s["run"]))
        s["simulated_hit_rate"] = simulate(trace, n, policy, capacity, decode_ms, prefill_tps,
                                           args.balance_factor, args.balance_slack,
                                           args.hash_key_tokens)
        # The same with the decode and prefill speeds this run itself saw: four replicas on a
        # shared machine run slower than one, and the speed decides how many requests overlap,
        # which the load bounds react to.
        s["simulated_hit_rate_run_cal"] = simulate(
            trace, n, policy, capacity, s["tpot_p50_ms"], s.get("prefill_tps", prefill_tps),
            args.balance_factor, args.balance_slack, args.hash_key_tokens)
    single = alone["hit_rate"]
    print(f"\n{'run':<16}{'hit rate':>9}{'sim':>8}{'Δ pts':>7}{'sim/run':>8}{'Δ pts':>7}"
          f"{'vs 1':>7}{'TTFT p50':>10}{'p99':>9}{'req/s':>7}{'tok/s':>8}{'fail*':>6}{'cut':>5}"
          "  per replica")
    for s in runs:
        print(f"{s['run']:<16}{100 * s['hit_rate']:>8.1f}%{100 * s['simulated_hit_rate']:>7.1f}%"
              f"{100 * (s['simulated_hit_rate'] - s['hit_rate']):>+7.1f}"
              f"{100 * s['simulated_hit_rate_run_cal']:>7.1f}%"
              f"{100 * (s['simulated_hit_rate_run_cal'] - s['hit_rate']):>+7.1f}"
              f"{100 * s['hit_rate'] / single if single else 0:>6.0f}%"
              f"{s['ttft_p50_ms']:>8.1f}ms{s['ttft_p99_ms']:>7.1f}ms{s['req_per_s']:>7.2f}"
              f"{s['out_tok_per_s']:>8.1f}{s['failed_not_started']:>6}{s['cut_mid_stream']:>5}"
              f"  {s['per_replica']}")
    print("sim: the simulator with the alone run's speeds; sim/run: with the run's own; "
          "fail*: failed requests that had not started streaming; cut: streams cut mid-way")
    for s in runs:
        if s.get("killed"):
            print(f"failover: replica {s['killed']['replica']} killed (SIGKILL) halfway with "
                  f"{s['killed']['in_flight']} requests in flight; {s['cut_mid_stream']} streams "
                  f"cut mid-way (ended by an error event), {s['failed_not_started']} failed "
                  f"before streaming, {s['gateway_retries']:.0f} retried on another replica; "
                  f"sim = the same trace without the kill; gateway errors: "
                  f"{'; '.join(s['gateway_errors'])}")
    if args.record:
        record(args, runs, len(trace.requests))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=runs, capacity_tokens=capacity,
                                                   decode_ms=decode_ms,
                                                   prefill_tokens_per_s=prefill_tps), indent=1))
    return 0


def record(args: argparse.Namespace, runs: list[dict], requests: int) -> None:
    """The figures page's record: each policy's hit rate against one replica's (issue 17:
    cache_aware >= 0.9x), the simulator's gap, the failover and the gateway's overhead."""
    by = {s["run"]: s for s in runs}
    alone = 100 * by["alone"]["hit_rate"]
    rows = [Row(f"{p} hit rate / one replica's", "%", round(100 * by[p]["hit_rate"], 1),
                round(alone, 1), ratio(100 * by[p]["hit_rate"], alone),
                ">= 0.9x" if p == "cache_aware" else None,
                by[p]["hit_rate"] >= 0.9 * by["alone"]["hit_rate"] if p == "cache_aware"
                else None) for p in args.policies.split(",")]
    gaps = {s["run"]: 100 * abs(s["simulated_hit_rate_run_cal"] - s["hit_rate"]) for s in runs
            if not s["run"].endswith("burst") and s["run"] != "alone"}  # alone: calibration
    worst = max(gaps, key=gaps.get)
    rows.append(Row(f"simulator's largest gap, own speeds ({worst})", "points",
                    round(gaps[worst], 1), target="<= 5 points", met=gaps[worst] <= 5))
    if "failover" in by:
        n = by["failover"]["failed_not_started"]
        rows.append(Row("failover: requests failed before streaming", "requests", n,
                        target="0", met=n == 0))
    rows.append(Row("gateway + 1 replica TTFT p50 / replica alone", "ms",
                    round(by["gw+1"]["ttft_p50_ms"], 1), round(by["alone"]["ttft_p50_ms"], 1),
                    ratio(by["gw+1"]["ttft_p50_ms"], by["alone"]["ttft_p50_ms"])))
    write_record(args.record, name="bench-route", rows=rows,
                 title=f"The gateway across {args.replicas} replicas",
                 peer="none: one replica alone (the single-replica hit rate, the replica "
                 "without the gateway)", notes=f"{requests} requests of the simulator's gsp "
                 f"trace at {args.rate} req/s.")


if __name__ == "__main__":
    sys.exit(main())
