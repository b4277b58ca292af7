"""`kvserve bench soak`: does a long-running `kvserve serve` keep its RSS flat under concurrent
load?

It starts a real server process on 127.0.0.1 (the embedded default model unless --server-args
names another), then runs rounds until --minutes have passed: each round sends --concurrency
streaming completions at once, a fraction of which (--abort-fraction) disconnect mid-stream
after their first chunks, as impatient clients do. After each round it waits for the engine to
be idle, lets the server settle, and reads the server's VmRSS from /proc/PID/status.

Written to --out-dir: rounds.csv (one line per round), summary.json, the server log and the
plot of RSS per round (--plot, default OUT_DIR/soak_rss.png). The verdict compares every round
after the warm-up with the RSS at the end of the warm-up: flat if all stay within --tolerance
(5%), and gives the least-squares slope of the post-warm-up rounds. Exit status 1 if not flat.

Every prompt is new (random words), so the prefix cache keeps receiving new blocks: the cache
fills its KV pool once and then evicts, which is the steady state of a long-running server.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvserve.bench import spawn
from kvserve.bench.client import sse_lines
from kvserve.utils.ports import free_port

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu kernel "
         "cache block token server batch memory round soak stream abort").split()


@dataclass
class Round:
    """What one round did and the server's memory after it settled."""

    round: int
    t_s: float  # seconds since the first round started, at the RSS reading
    duration_s: float
    completed: int
    aborted: int
    errors: int
    rss_kb: int
    rss_anon_kb: int
    hwm_kb: int
    threads: int


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, VmHWM (kB) and Threads of a process, from /proc/PID/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def engine_idle(url: str) -> bool:
    """No request running or waiting, per /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    busy = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting"):
            busy += sum(s.value for s in family.samples)
    return busy == 0


# ------------------------------------------------------------------------------------------
# the load
# ------------------------------------------------------------------------------------------

def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      abort_after: int | None) -> str:
    """Stream one completion; with `abort_after`, leave after that many chunks (the connection
    closes with the unread response). Returns 'completed', 'aborted' or 'error'."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.8, "stream_options": {"include_usage": True}}
    chunks = 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return "error"
            async for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "completed"
                if '"error"' in line[:20]:
                    return "error"
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    return "aborted"  # leaving the `async with` drops the connection
        return "error"  # the stream ended without [DONE]
    except httpx.HTTPError:
        return "error"


async def run_round(url: str, rng: random.Random, args: argparse.Namespace) -> dict[str, int]:
    """`--concurrency` requests at once, each on its own connection (so an abort really closes
    a socket, as a client going away does)."""
    limits = httpx.Limits(max_connections=args.concurrency + 16, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        tasks = []
        for _ in range(args.concurrency):
            abort = rng.randint(1, max(1, args.max_tokens // 2)) \
                if rng.random() < args.abort_fraction else None
            prompt = make_prompt(rng, rng.randint(args.min_words, args.max_words))
            tasks.append(one_request(http, url, prompt, args.max_tokens, abort))
        results = await asyncio.gather(*tasks)
    return {k: results.count(k) for k in ("completed", "aborted", "error")}


def one_round(url: str, rng: random.Random, args: argparse.Namespace, proc: subprocess.Popen,
              t0: float) -> "Round":
    """Run one round, let the server settle, and read its memory."""
    r0 = time.monotonic()
    counts = asyncio.run(run_round(url, rng, args))
    took = time.monotonic() - r0
    settle(url, args.settle)
    st = proc_status(proc.pid)
    return Round(0, round(time.monotonic() - t0, 1), round(took, 2), counts["completed"],
                 counts["aborted"], counts["error"], st["VmRSS"], st.get("RssAnon", 0),
                 st["VmHWM"], st["Threads"])


def settle(url: str, seconds: float) -> None:
    """Wait until the engine has nothing running or waiting, then `seconds` more, so that
    aborts have been processed and short-lived buffers freed before RSS is read."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if engine_idle(url):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    time.sleep(seconds)


# ------------------------------------------------------------------------------------------
# the verdict and the plot
# ------------------------------------------------------------------------------------------

def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def verdict(rounds: list[Round], warmup: int, tolerance: float) -> dict:
    """Flat if every round after the warm-up is within `tolerance` of the RSS at its end."""
    warmup = min(warmup, max(0, len(rounds) - 2))
    base = rounds[warmup - 1] if warmup else rounds[0]
    after = rounds[warmup:]
    rss = [r.rss_kb for r in after]
    per_round = slope([r.round for r in after], rss)
    per_hour = slope([r.t_s / 3600 for r in after], rss)
    worst = max(abs(v - base.rss_kb) for v in rss) / base.rss_kb
    return {"warmup_rounds": warmup, "rounds": len(rounds), "duration_s": rounds[-1].t_s,
            "rss_warmup_end_kb": base.rss_kb, "rss_end_kb": rounds[-1].rss_kb,
            "rss_max_after_warmup_kb": max(rss), "rss_min_after_warmup_kb": min(rss),
            "growth_pct": 100.0 * (rounds[-1].rss_kb - base.rss_kb) / base.rss_kb,
            "max_deviation_pct": 100.0 * worst,
            "slope_kb_per_round": per_round, "slope_mb_per_hour": per_hour / 1024,
            "tolerance_pct": 100.0 * tolerance, "flat": worst <= tolerance}


def plot(rounds: list[Round], summary: dict, path: Path, title: str,
         compare: list[tuple[str, list[Round]]] = ()) -> None:
    """RSS per round with the warm-up and the tolerance band; `compare` overlays the VmRSS of
    other runs (e.g. the same soak before a fix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = [r.round for r in rounds]
    ax.plot(xs, [r.rss_kb / 1024 for r in rounds], marker=".", markersize=3, label="VmRSS")
    ax.plot(xs, [r.rss_anon_kb / 1024 for r in rounds], alpha=0.6, label="RssAnon")
    for label, other in compare:
        ax.plot([r.round for r in other], [r.rss_kb / 1024 for r in other], linestyle="--",
                alpha=0.8, label=f"VmRSS, {label}")
    base = summary["rss_warmup_end_kb"] / 1024
    tol = summary["tolerance_pct"] / 100
    w = summary["warmup_rounds"]
    if w:
        ax.axvspan(xs[0] - 0.5, w + 0.5, color="grey", alpha=0.15, label="warm-up")
    ax.axhspan(base * (1 - tol), base * (1 + tol), color="green", alpha=0.08,
               label=f"±{summary['tolerance_pct']:.0f}% of RSS at warm-up end")
    ax.set_xlabel("round")
    ax.set_ylabel("server memory (MiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right" if not compare else "upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------

def write_rounds(rounds: list[Round], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rounds[0])))
        w.writeheader()
        for r in rounds:
            w.writerow(asdict(r))


def read_rounds(path: Path) -> list[Round]:
    with open(path, newline="") as f:
        return [Round(**{k: (float(v) if k in ("t_s", "duration_s") else int(v))
                         for k, v in row.items()}) for row in csv.DictReader(f)]


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The server's environment: its threads, --debug-memory and --server-env pairs."""
    env = {"OMP_NUM_THREADS": str(args.num_threads)}
    if args.debug_memory:
        env["KVSERVE_DEBUG_MEMORY"] = args.debug_memory
    for item in args.server_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def run_soak(args: argparse.Namespace, out: Path) -> tuple[list[Round], int]:
    """Start the server, run rounds for `--minutes`; the rounds and the RSS at start (kB)."""
    from tqdm import tqdm

    port = free_port()
    # /debug/memory is an admin route: the soak's own keyless server makes its caller the admin
    admin = ["--allow-unauthenticated-admin"] if args.debug_memory else []
    cmd = spawn.kvserve_command(port, None, ["--max-model-len", str(args.max_model_len),
                                             "--num-threads", str(args.num_threads), *admin,
                                             *args.server_args.split()])
    rng = random.Random(args.seed)
    rounds: list[Round] = []
    # SIGTERM (kill, nohup'd runs) ends the rounds like Ctrl-C: the server is stopped and what
    # was measured so far is still summarised and plotted.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with open(out / "server.log", "wb") as log, \
            spawn.server(cmd, port, log=log, env=server_env(args)) as (url, proc):
        start = proc_status(proc.pid)
        print(f"server pid {proc.pid}, RSS at start {start['VmRSS'] / 1024:.1f} MiB", flush=True)
        t0 = time.monotonic()
        budget = args.minutes * 60
        bar = tqdm(total=int(budget), unit="s", desc="soak", mininterval=5)
        while time.monotonic() - t0 < budget:
            try:
                rounds.append(one_round(url, rng, args, proc, t0))
                rounds[-1].round = len(rounds)
            except KeyboardInterrupt:
                print("\ninterrupted: summarising the rounds so far", flush=True)
                break
            last = rounds[-1]
            bar.update(min(int(time.monotonic() - t0), int(budget)) - bar.n)
            bar.set_postfix(round=last.round, rss_mib=f"{last.rss_kb / 1024:.1f}",
                            err=last.errors)
            write_rounds(rounds, out / "rounds.csv")
            if args.debug_memory:
                with open(out / "debug_memory.jsonl", "a") as f:
                    report = httpx.get(f"{url}/debug/memory", timeout=120).json()
                    f.write(json.dumps({"round": last.round, **report}) + "\n")
            if proc.poll() is not None:
                raise SystemExit(f"the server died (exit {proc.returncode})")
        bar.close()
    return rounds, start["VmRSS"]


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="run rounds for this long")
    p.add_argument("--concurrency", type=int, default=256, help="requests per round, all at once")
    p.add_argument("--abort-fraction", type=float, default=0.25,
                   help="fraction of requests that disconnect mid-stream")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=48)
    p.add_argument("--warmup-rounds", type=int, default=None,
                   help="rounds before the RSS baseline (default: 10%% of the rounds, >= 3)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds idle before reading RSS")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--server-args", default="", help="extra `kvserve serve` flags, one string")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the server (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--debug-memory", nargs="?", const="1", default=None,
                   choices=["1", "tracemalloc"],
                   help="run the server with KVSERVE_DEBUG_MEMORY=1 (or =tracemalloc: slow) and "
                   "save its /debug/memory report after every round to debug_memory.jsonl")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="soak-out")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="the RSS plot (default: OUT_DIR/soak_rss.png)")
    p.add_argument("--title", default=None)
    p.add_argument("--compare", action="append", default=[], metavar="CSV=LABEL",
                   help="overlay the RSS of another run's rounds.csv on the plot; repeatable")
    p.add_argument("--from-csv", default=None, metavar="CSV",
                   help="start no server: summarise and plot this rounds.csv again")


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.abort_fraction <= 1.0:
        raise SystemExit("--abort-fraction must be in [0, 1]")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_csv:
        rounds, start_kb = read_rounds(Path(args.from_csv)), None
    else:
        rounds, start_kb = run_soak(args, out)
    if len(rounds) < 2:
        raise SystemExit("fewer than two rounds: run longer")
    warmup = args.warmup_rounds if args.warmup_rounds is not None \
        else max(3, len(rounds) // 10)
    summary = verdict(rounds, warmup, args.tolerance)
    summary.update(concurrency=args.concurrency, abort_fraction=args.abort_fraction,
                   max_tokens=args.max_tokens, server_args=args.server_args,
                   server_env=args.server_env, rss_start_kb=start_kb,
                   requests=sum(r.completed + r.aborted + r.errors for r in rounds),
                   errors=sum(r.errors for r in rounds))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = args.title or (f"kvserve serve RSS per round: {len(rounds)} rounds x "
                           f"{args.concurrency} streams ({100 * args.abort_fraction:.0f}% aborted),"
                           f" {summary['duration_s'] / 60:.0f} min")
    compare = []
    for item in args.compare:
        path, _, label = item.partition("=")
        compare.append((label or path, read_rounds(Path(path))))
    plot_path = Path(args.plot) if args.plot else out / "soak_rss.png"
    plot(rounds, summary, plot_path, title, compare)
    mib = 1 / 1024
    print(f"rounds {len(rounds)} in {summary['duration_s'] / 60:.1f} min, "
          f"{summary['requests']} requests ({summary['errors']} errors)")
    at_start = f"{start_kb * mib:.1f} MiB" if start_kb is not None else "n/a"
    print(f"RSS start {at_start}, after warm-up ({warmup} rounds) "
          f"{summary['rss_warmup_end_kb'] * mib:.1f} MiB, end {summary['rss_end_kb'] * mib:.1f} "
          f"MiB: growth {summary['growth_pct']:+.2f}%, max deviation "
          f"{summary['max_deviation_pct']:.2f}%, slope {summary['slope_kb_per_round']:+.1f} "
          f"kB/round ({summary['slope_mb_per_hour']:+.2f} MiB/h)")
    print(f"VERDICT: RSS {'FLAT' if summary['flat'] else 'NOT flat'} within "
          f"{summary['tolerance_pct']:.0f}% after warm-up; plot {plot_path}")
    return 0 if summary["flat"] else 1
