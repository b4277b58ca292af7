#!/usr/bin/env python
"""Swap preemption (issue 34): how fast a preempted 4,000-token request resumes with swap vs
recompute, on a fresh engine per run, the modes alternating (medians of `--repeats`).

The scene: a short request B decodes; a long request A is admitted into a pool that holds both
only for a few more tokens, so A, the youngest, is preempted; B is then aborted and A resumes
in the next step. Timed: the resume (the readmitting step to A's next token: a prefill of all
its tokens, or its blocks loaded back and a decode), and the swap-out (the preempting step
less a plain decode step). Prefix caching is off, so that recompute really recomputes.

    .venv/bin/python benchmarks/bench_swap.py [--prompt-tokens 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from kvserve.bench.record import current_machine

MARGIN = 48  # tokens both requests can still decode before the pool runs out


def one_run(mode: str, model: str | None, prompt_tokens: int, threads: int, seed: int) -> dict:
    """One scene on a fresh engine; returns the resume and swap-out times (seconds)."""
    from kvserve import LLM, SamplingParams
    from kvserve.request import RequestStatus

    block = 16
    b_prompt = 16
    llm = LLM(model=model, dtype="float32", num_threads=threads, block_size=block,
              max_model_len=prompt_tokens + 512, enable_prefix_caching=False,
              preemption_mode=mode, kv_cache_memory_bytes=2**26)  # to size the real pool
    engine = llm.engine
    # A pool of exactly A's prompt + B's prompt + MARGIN tokens each, in blocks.
    per_block = engine.tensors.page_bytes * len(engine.tensors.layers)
    blocks = -(-(prompt_tokens + b_prompt + 2 * MARGIN) // block)
    del llm, engine
    llm = LLM(model=model, dtype="float32", num_threads=threads, block_size=block,
              max_model_len=prompt_tokens + 512, enable_prefix_caching=False,
              preemption_mode=mode, kv_cache_memory_bytes=blocks * per_block)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(b_prompt)]},
                       params, request_id="B")
    engine.step()
    # A alone fits the pool to its end (the engine refuses a request that never could); with B
    # beside it, the pool runs out about MARGIN tokens in.
    engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab)
                                             for _ in range(prompt_tokens)]},
                       SamplingParams(temperature=0.0, max_tokens=MARGIN + 32, ignore_eos=True),
                       request_id="A")
    a = engine._groups["A"][0]
    decode_times: list[float] = []
    out_step = None
    while True:  # until A is preempted
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if a.status is RequestStatus.WAITING and a.num_preemptions:
            out_step = dt
            break
        if len(a.output_token_ids) > 1:
            decode_times.append(dt)
        assert not a.finished, "A was never preempted"
    tokens_before = len(a.output_token_ids)
    engine.abort_request("B")
    t0 = time.perf_counter()
    while len(a.output_token_ids) == tokens_before:
        engine.step()
    resume = time.perf_counter() - t0
    swap = engine.stats().swap
    engine.abort_request("A")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "blocks leaked"
    plain = statistics.median(decode_times[-8:]) if decode_times else 0.0
    return {"resume": resume, "swap_out": out_step - plain, "decode": plain,
            "computed": a.num_computed_tokens, "swapped_in": swap.get("swapped_in", 0),
            "bytes": swap.get("bytes_in", 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(current_machine())
    rows: dict[str, list[dict]] = {"recompute": [], "swap": []}
    for r in range(args.repeats):  # alternating, so that drift hits both alike
        for mode in rows:
            rows[mode].append(one_run(mode, args.model, args.prompt_tokens, args.threads, r))
    print(f"\npreempted request of {args.prompt_tokens:,} prompt tokens, median of "
          f"{args.repeats} (fresh engine each), ms")
    print(f"{'mode':<10} {'resume':>9} {'swap-out':>9} {'decode step':>12}  swapped in")
    med = {}
    for mode, runs in rows.items():
        res = [x["resume"] for x in runs]
        med[mode] = statistics.median(res)
        print(f"{mode:<10} {1000 * med[mode]:9.1f} "
              f"{1000 * statistics.median(x['swap_out'] for x in runs):9.1f} "
              f"{1000 * statistics.median(x['decode'] for x in runs):12.1f}  "
              f"{runs[0]['swapped_in']} ({runs[0]['bytes'] / 1e6:.1f} MB)"
              f"   [resume {1000 * min(res):.1f}-{1000 * max(res):.1f}]")
    if all(x["swapped_in"] == 1 for x in rows["swap"]):
        print(f"\nresume speed-up, swap over recompute: x{med['recompute'] / med['swap']:.1f}")
    else:
        print("\nthe swap mode did not swap every run (see swapped in)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
