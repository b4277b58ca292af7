#!/usr/bin/env python
"""Bounded KV caches (issue 15, part 3) on the trained model: held-out perplexity, greedy
agreement with the full cache, and memory, at budgets that are fractions of the context.

Scoring is by *forced decoding* through the engine, so every scored token is computed with the
bounded cache in force: each window of --context held-out tokens (kvserve.eval.heldout) is cut
into a --prefix prompt (prefilled with full attention, as the policies prescribe) and the rest,
which is fed one token per step as the "sampled" token (a sampler stand-in returns the
held-out token and records its log-probability and the argmax). The windows of one run decode
side by side in the same batches. Greedy agreement is the fraction of scored positions whose
argmax equals the full cache's argmax at the same position (both see the same forced text).
Memory: the KV blocks a request holds at the end of its window (the last step before it
finishes), and what that is of the full cache's.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --windows 4
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.eval.heldout import stdlib_files
from kvserve.eval.perplexity import corpus_tokens, windows
from kvserve.kv.bounded import POLICIES, BoundedKVConfig
from kvserve.sampler import SampleResult

MODEL = Path(__file__).resolve().parent.parent / "kvserve" / "models" / "stdlib-coder"


def cpu_line() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0] \
        if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"ISA: {' '.join(isa) or 'baseline'}")


class ForcedSampler:
    """Returns each request's next held-out token instead of sampling, and records the
    log-probability the model gave it and the model's argmax (per request, by position)."""

    def __init__(self, texts: dict[int, list[int]], prefix: int) -> None:
        self.texts = texts  # id(prompt list) -> the window
        self.prefix = prefix
        self.logprob: dict[int, list[float]] = {k: [] for k in texts}
        self.argmax: dict[int, list[int]] = {k: [] for k in texts}

    def __call__(self, logits: torch.Tensor, rows, token_bitmask=None) -> SampleResult:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = []
        for i, row in enumerate(rows):
            key = id(row.prompt_token_ids)
            target = self.texts[key][self.prefix + len(row.output_token_ids)]
            self.logprob[key].append(logp[i, target].item())
            self.argmax[key].append(int(logp[i].argmax()))
            tokens.append(target)
        return SampleResult(tokens, [None] * len(rows), [None] * len(rows))


def run(wins: list[list[int]], prefix: int, bounded: BoundedKVConfig | None, block_size: int
        ) -> dict:
    llm = LLM(model=str(MODEL), dtype="float32", block_size=block_size,
              max_model_len=len(wins[0]), enable_prefix_caching=False)
    engine = llm.engine
    prompts = [w[:prefix] for w in wins]
    params = SamplingParams(temperature=0.0, max_tokens=len(wins[0]) - prefix - 1,
                            ignore_eos=True, detokenize=False)
    ids = [engine.add_request({"prompt_token_ids": p}, params, bounded_kv=bounded)
           for p in prompts]
    # Keyed by the requests' own prompt lists (the rows the engine samples carry them).
    sampler = ForcedSampler({id(r.prompt_token_ids): w
                             for r, w in zip(engine.scheduler.waiting, wins)}, prefix)
    engine.sampler = sampler
    keys = list(sampler.texts)
    end = 0  # blocks held per request after the last step before they finish
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        held = [len(engine.kv.block_tables.get(i, ())) for i in ids]
        end = max(held) or end
    seconds = time.perf_counter() - start
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "KV blocks leaked"
    logprobs = [lp for k in keys for lp in sampler.logprob[k]]
    bytes_per_block = engine.kv_spec.bytes_per_block
    return {"nll": -sum(logprobs) / len(logprobs), "tokens": len(logprobs),
            "argmax": [sampler.argmax[k] for k in keys], "end_blocks": end,
            "end_bytes": end * bytes_per_block, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=256, help="prompt tokens, full attention")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tokens = corpus_tokens(_tokenizer(), stdlib_files("heldout"),
                           args.context * args.windows)
    wins = windows(tokens, args.context)[:args.windows]
    assert all(len(w) == args.context for w in wins), "not enough held-out text"
    print(cpu_line())
    print(f"model {MODEL.name}, {len(wins)} held-out windows of {args.context} tokens, "
          f"prompt {args.prefix} tokens (full attention), then {args.context - args.prefix - 1} "
          f"forced decode steps each; block size {args.block_size}")
    full = run(wins, args.prefix, None, args.block_size)
    print(f"full cache: perplexity {math.exp(full['nll']):.3f}, {full['end_blocks']} blocks "
          f"({full['end_bytes'] / 2**20:.2f} MiB) per request at the end, "
          f"{full['seconds']:.1f} s")
    for policy in args.policies:
        print(f"\n{policy} (sink tokens {args.sink_tokens})")
        print("| budget | tokens kept | perplexity | vs full | greedy agreement | KV blocks held "
              "at the end | KV memory saved | time |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| full | {args.context} | {math.exp(full['nll']):.3f} | 1.000 | 100.0% | "
              f"{full['end_blocks']} | - | {full['seconds']:.0f} s |")
        for fraction in args.fractions:
            bounded = BoundedKVConfig(policy, fraction, args.sink_tokens)
            r = run(wins, args.prefix, bounded, args.block_size)
            agree = [a == b for x, y in zip(r["argmax"], full["argmax"]) for a, b in zip(x, y)]
            print(f"| {fraction:.0%} | {int(fraction * args.context)} | "
                  f"{math.exp(r['nll']):.3f} | {math.exp(r['nll'] - full['nll']):.3f} | "
                  f"{100 * sum(agree) / len(agree):.1f}% | {r['end_blocks']} | "
                  f"{1 - r['end_blocks'] / full['end_blocks']:.0%} | {r['seconds']:.0f} s |",
                  flush=True)


def _tokenizer():
    from kvserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(MODEL)


if __name__ == "__main__":
    main(sys.argv[1:])
