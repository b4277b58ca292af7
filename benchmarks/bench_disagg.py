#!/usr/bin/env python
"""Prefill/decode disaggregation (issue 34): decode inter-token latency while long prompts
arrive, disaggregated against colocated, side by side in one run.

Both deployments get the same load through a `kvserve route` gateway (the same extra hop):
`--decoders` streams decoding all the time (short prompts, `--decode-tokens` each, restarted
when done) and a long prompt (`--prompt-tokens`) arriving every `--long-every` seconds.

* colocated: one `kvserve serve` on both cores with two threads;
* disaggregated: a producer pinned to core 0 and a consumer pinned to core 1 (one thread each,
  `taskset`), `--kv-transfer-config` with the `kvserve` connector; the gateway sends each
  request to the producer for its prompt, then to the consumer.

Prints per deployment the long prompts' TTFT, the decode streams' inter-token latency p50/p99
and the output throughput; the ratio of the ITL p99s. The deployments run one after the other,
never together. The model is the embedded SmolLM2-135M unless `--model` says otherwise.

    .venv/bin/python benchmarks/bench_disagg.py
    .venv/bin/python benchmarks/bench_disagg.py --duration 40 --prompt-tokens 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_route import Proc, free_port  # noqa: E402
from bench_swap import cpu_line  # noqa: E402

WORDS = ("the cache holds blocks of keys and values for every token a model has seen so that "
         "decoding reads them again instead of computing them").split()


def serve(name: str, model: list[str], logs: Path, cores: str | None, threads: int,
          *extra: str) -> Proc:
    pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
    return Proc(name, ["serve", *model, "--served-model-name", "m", "--num-threads",
                       str(threads), "--max-model-len", "4096", "--disable-log-stats", *extra],
                logs, threads, pin)


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
                 ) -> tuple[float, list[float]]:
    """(time to first token, arrival times of every token) of one streamed completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return (times[0] - t0 if times else float("nan")), times


async def load(url: str, args) -> dict:
    rng = random.Random(0)
    deadline = time.perf_counter() + args.duration
    itls: list[float] = []
    ttfts: list[float] = []
    tokens = 0

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    async with httpx.AsyncClient(timeout=600) as client:
        async def decoder(i: int) -> None:
            nonlocal tokens
            while time.perf_counter() < deadline:
                _, times = await stream(client, url, f"{i} " + words(24), args.decode_tokens)
                itls.extend(b - a for a, b in zip(times, times[1:]))
                tokens += len(times)

        async def long_prompts() -> None:
            nonlocal tokens
            pending = []
            await asyncio.sleep(2.0)  # the decoders are running first
            while time.perf_counter() < deadline - 2:
                pending.append(asyncio.create_task(
                    stream(client, url, words(int(args.prompt_tokens * 0.75)), 8)))
                await asyncio.sleep(args.long_every)
            for ttft, times in await asyncio.gather(*pending):
                ttfts.append(ttft)
                tokens += len(times)

        t0 = time.perf_counter()
        await asyncio.gather(long_prompts(), *(decoder(i) for i in range(args.decoders)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(itls, n=100)
    return {"ttft_p50": statistics.median(ttfts), "itl_p50": statistics.median(itls),
            "itl_p99": q[98], "tok_s": tokens / wall, "long": len(ttfts), "itls": len(itls)}


def run(kind: str, args, logs: Path) -> dict:
    model = [args.model] if args.model else []
    procs: list[Proc] = []
    try:
        if kind == "colocated":
            one = serve("colocated", model, logs, None, 2)
            procs.append(one)
            one.wait_ready()
            route = ["route", "--replica", one.url]
        else:
            port = free_port()
            prod = serve("producer", model, logs, "0", 1, "--kv-transfer-config",
                         json.dumps({"kv_connector": "kvserve", "kv_role": "kv_producer",
                                     "kv_port": port}))
            cons = serve("consumer", model, logs, "1", 1, "--kv-transfer-config",
                         json.dumps({"kv_connector": "kvserve", "kv_role": "kv_consumer"}))
            procs += [prod, cons]
            prod.wait_ready()
            cons.wait_ready()
            route = ["route", "--prefill", prod.url, "--decode", cons.url]
        gw = Proc(f"gateway-{kind}", route + ["--tokenizer", args.model or "default"], logs)
        procs.append(gw)
        gw.wait_ready()
        return asyncio.run(load(gw.url, args))
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--long-every", type=float, default=3.0)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0)
    args = p.parse_args()
    print(cpu_line())
    logs = Path(tempfile.mkdtemp(prefix="kvserve-disagg-"))
    rows = {kind: run(kind, args, logs) for kind in ("colocated", "disaggregated")}
    print(f"\n{args.decoders} decode streams x {args.decode_tokens} tokens, a "
          f"~{args.prompt_tokens}-token prompt every {args.long_every} s, {args.duration} s")
    print(f"{'deployment':<14} {'TTFT p50 (long)':>16} {'ITL p50':>9} {'ITL p99':>9} "
          f"{'tok/s':>7}  samples")
    for kind, r in rows.items():
        print(f"{kind:<14} {1000 * r['ttft_p50']:13.0f} ms {1000 * r['itl_p50']:6.1f} ms "
              f"{1000 * r['itl_p99']:6.1f} ms {r['tok_s']:7.1f}  {r['long']} long, "
              f"{r['itls']} gaps")
    ratio = rows["disaggregated"]["itl_p99"] / rows["colocated"]["itl_p99"]
    print(f"\nITL p99, disaggregated / colocated: {ratio:.2f} (logs: {logs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
