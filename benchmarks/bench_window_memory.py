#!/usr/bin/env python
"""Memory that follows the window (issue 15 part 2, acceptance 2), random weights, float32:
the tiny Mistral with --window on every layer and the small Gemma 3 (seven local layers, one
global), block release on (the default) and off (`disable_hybrid_kv_cache_manager`).

A. blocks a --length-token request holds at its last step, per KV group, beside what `kvserve
   plan`'s code computes for it, and the bytes in all;
B. --requests requests of --length tokens against a pool of --pool-requests full-length
   requests: the most running at once, preemptions and wall time.

Part 1's speed comparison (window against full attention) is `kvserve bench throughput` on two
checkpoints: docs/figures/sliding-window.md gives the commands.

    .venv/bin/python benchmarks/bench_window_memory.py [--length 4096] [--window 512]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.record import current_machine
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.model_loader.make_model import make_model
from kvserve.planner.memory import kv_cache_spec, make_plan
from kvserve.planner.model import ModelSpec

BLOCK = 16


def _llm(path: Path, keep_all: bool, max_len: int, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=BLOCK, max_model_len=max_len,
               num_threads=2, disable_hybrid_kv_cache_manager=keep_all, **kwargs)


def held_at_end(path: Path, length: int, keep_all: bool) -> tuple[list[int], LLM]:
    """Blocks each of the request's tables holds at its last step, and the engine."""
    llm = _llm(path, keep_all, length, enable_prefix_caching=False, max_num_batched_tokens=1024)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length - 8)]},
                       SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    held: list[int] = []
    forward = engine.runner.forward

    def recording(seqs, *a, **kw):  # the tables as the step's forward reads them
        held[:] = [sum(b != NULL_BLOCK for b in t) for t in seqs[0].block_tables]
        return forward(seqs, *a, **kw)

    engine.runner.forward = recording
    while engine.has_unfinished_requests():
        engine.step()
    return held, llm


def table_a(paths: dict[str, Path], length: int) -> None:
    print(f"\nA. blocks held by one {length:,}-token request at its last step (block size {BLOCK})")
    print(f"{'layout':16} {'group':26} {'planner':>8} {'release':>8} {'keep all':>9} "
          f"{'release/full':>13}")
    for name, path in paths.items():
        released, llm = held_at_end(path, length, False)
        (kept,), _ = held_at_end(path, length, True)
        engine = llm.engine
        spec = engine.kv_spec
        groups = engine.page_groups or spec.groups  # the engine's tables' groups
        for g, n in zip(groups, released):
            window = getattr(g.spec, "window", None)
            planned = -(-g.spec.tokens_held(length) // BLOCK)
            label = f"layers {','.join(map(str, g.layers))}: " + \
                (f"window {window}" if window else "full")
            print(f"{name:16} {label:26} {planned:>8} {n:>8} {kept:>9} {n / kept:>12.3f}x")
        page = spec.page_bytes(engine.page_groups)
        mib = 2 ** 20
        print(f"{name:16} {'all layers, MiB':26} {spec.bytes_per_request(length) / mib:>8.2f} "
              f"{sum(released) * page / mib:>8.2f} {kept * spec.bytes_per_block / mib:>9.2f} "
              f"{sum(released) * page / (kept * spec.bytes_per_block):>12.3f}x")


def run_workload(path: Path, keep_all: bool, args) -> dict:
    pool_tokens = args.pool_requests * args.length
    bytes_per_token = kv_cache_spec(ModelSpec.load(str(path)), "fp32").bytes_per_token
    llm = _llm(path, keep_all, args.length, enable_prefix_caching=False,
               max_num_batched_tokens=2048, max_num_seqs=args.requests,
               kv_cache_memory_bytes=pool_tokens * bytes_per_token)
    engine = llm.engine
    assert engine.kv.num_blocks * BLOCK == pool_tokens * engine.kv.num_groups, \
        "the pool is not the size asked for"
    rng = random.Random(1)
    prompt_len = args.length - args.output
    params = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0.0)
    for _ in range(args.requests):
        engine.add_request({"prompt_token_ids": [rng.randrange(3, 2048)
                                                 for _ in range(prompt_len)]}, params)
    peak = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return dict(peak=peak, preemptions=engine.scheduler.num_preemptions,
                seconds=time.perf_counter() - t, blocks=engine.kv.num_blocks,
                line_x=engine.kv.num_blocks / engine.kv.final_blocks(args.length),
                pool_bytes=pool_tokens * bytes_per_token)


def table_b(name: str, path: Path, args) -> None:
    res = {keep: run_workload(path, keep, args) for keep in (True, False)}
    plan = make_plan(ModelSpec.load(str(path)), kv_dtype="fp32", context_len=args.length,
                     block_size=BLOCK, kv_cache_memory=res[False]["pool_bytes"])
    planner_x = plan["capacity"]["max_concurrency"]
    print(f"\nB. {args.requests} requests of {args.length - args.output:,} + {args.output} tokens, "
          f"pool = {args.pool_requests} full-length requests ({res[True]['blocks']:,} blocks of "
          f"every layer, {res[False]['blocks']:,} with release), {name}")
    print(f"{'':10} {'start-up line':>14} {'peak running':>13} {'preemptions':>12} {'wall s':>8}")
    for keep, label in ((True, "keep all"), (False, "release")):
        r = res[keep]
        print(f"{label:10} {r['line_x']:>13.2f}x {r['peak']:>13} {r['preemptions']:>12} "
              f"{r['seconds']:>8.1f}")
    print(f"{'ratio':10} {res[False]['line_x'] / res[True]['line_x']:>13.2f}x "
          f"{res[False]['peak'] / res[True]['peak']:>12.2f}x {'':>12} "
          f"{res[True]['seconds'] / res[False]['seconds']:>7.2f}x")
    print(f"kvserve plan's figure for this pool: {planner_x:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096, help="tokens per request")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--output", type=int, default=64, help="decode tokens per request in B")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--pool-requests", type=int, default=4)
    args = p.parse_args()
    print(current_machine())
    root = Path(tempfile.mkdtemp(prefix="bench-window-memory-"))
    try:
        mistral = make_model(root / "mistral", "mistral", "tiny", seed=0, overrides={
            "sliding_window": args.window, "max_position_embeddings": args.length})
        gemma = make_model(root / "gemma3", "gemma3", "small", seed=0)
        config = json.loads((gemma / "config.json").read_text())
        table_a({"mistral-style": mistral,
                 f"gemma3 ({config['num_hidden_layers']} layers)": gemma}, args.length)
        table_b(f"Mistral-style window {args.window}", mistral, args)
        table_b(f"Gemma 3 hybrid, window {config['sliding_window']}", gemma, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)

if __name__ == "__main__":
    main()
