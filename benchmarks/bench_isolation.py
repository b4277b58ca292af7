#!/usr/bin/env python
"""`--kv-isolation api_key` (issue 54): what a second tenant's identical prompt costs.

One `kvserve serve` process (the embedded SmolLM2 unless --model) with two tenant keys under
`--kv-isolation api_key`, then one with the default isolation (`cache_salt`, no salts). For each
of `--samples` fresh prompts of `--prompt-tokens` tokens (a long shared document with a
distinct head, as a RAG system prompt is): tenant A's cold TTFT (nothing cached), A's repeat
(warm), then tenant B's identical prompt. Under api_key, B's prompt must cost what a cold one
does and report 0 cached tokens; under cache_salt, B rides on A's cache. TTFT is the time to the
first streamed chunk, measured by the client; medians and ratios are printed with the CPU.

    .venv/bin/python benchmarks/bench_isolation.py
    .venv/bin/python benchmarks/bench_isolation.py --samples 5 --prompt-tokens 1500
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: list[str], isolation: str, threads: int, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "serve", *model, "--port", str(port),
            "--max-model-len", "4096", "--num-threads", str(threads), "--disable-log-stats",
            "--kv-isolation", isolation, "--api-key", KEYS["A"], "--api-key", KEYS["B"],
            "--admin-api-key", "sk-bench-admin"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start in 300 s")


def ttft(url: str, key: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed chunk, and the cached tokens the usage reported."""
    body = {"prompt": ids, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, cached = None, -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            if '"usage":{' in line and '"cached_tokens"' in line:
                cached = int(line.split('"cached_tokens":')[1].split("}")[0])
    return first, cached


def run(model: list[str], isolation: str, args) -> dict[str, list[tuple[float, int]]]:
    out: dict[str, list[tuple[float, int]]] = {"A cold": [], "A warm": [], "B same prompt": []}
    with tempfile.TemporaryFile() as log:
        proc, url = start(model, isolation, args.threads, log)
        try:
            ttft(url, KEYS["A"], [5] * 64)  # the first request's one-off costs
            for i in range(args.samples):
                doc = [100 + (j * 7919 + i * 104729) % 40000 for j in range(args.prompt_tokens)]
                out["A cold"].append(ttft(url, KEYS["A"], doc))
                out["A warm"].append(ttft(url, KEYS["A"], doc))
                out["B same prompt"].append(ttft(url, KEYS["B"], doc))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from kvserve.kernels.cpu.cpu_features import cpu_info

    print(f"cpu: {cpu_info().summary()}; {args.threads} threads; {args.samples} prompts of "
          f"{args.prompt_tokens} tokens; load average {os.getloadavg()[0]:.2f}")
    model = [args.model] if args.model else []
    for isolation in ("api_key", "cache_salt"):
        res = run(model, isolation, args)
        med = {k: statistics.median(t for t, _ in v) for k, v in res.items()}
        print(f"\n--kv-isolation {isolation}")
        for k, v in res.items():
            cached = sorted({c for _, c in v})
            print(f"  {k:14s} TTFT median {med[k] * 1000:8.1f} ms  "
                  f"[{min(t for t, _ in v) * 1000:.1f}-{max(t for t, _ in v) * 1000:.1f}]  "
                  f"cached tokens {cached}")
        print(f"  B / A cold = {med['B same prompt'] / med['A cold']:.2f}   "
              f"B / A warm = {med['B same prompt'] / med['A warm']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
