"""What the offline benchmarks (latency, throughput, prefix) share: the engine built from
`kvserve generate`'s engine flags, random token-id prompts, one timed `generate`."""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench.noise import Interference


def load_llm(args: argparse.Namespace, **overrides):
    """`LLM(**engine flags)` (what `kvserve generate` builds), and its load time in seconds;
    `overrides` win over the flags (a benchmark's own sizing)."""
    from kvserve import LLM

    kwargs = args.engine_kwargs(args)  # kvserve.entrypoints.cli's, set by add_bench_parser
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0


def token_prompts(llm, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids of the engine's vocabulary."""
    return random_prompts(n, length, llm.get_tokenizer().vocab_size, seed)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids, clear of the low ids where tokenizers keep
    their special tokens; the same ids for the same seed in every process (engines compared
    in separate workers get the same prompts)."""
    rng = random.Random(seed)
    return [[rng.randrange(min(100, vocab // 2), vocab) for _ in range(length)]
            for _ in range(n)]


def timed_generate(llm, prompts: list[list[int]], params, use_tqdm: bool = False):
    """generate() over token-id prompts: (outputs, wall seconds, the CPU other processes took
    meanwhile, the wall-clock time it started)."""
    reqs = [{"prompt_token_ids": p} for p in prompts]
    start = time.time()
    t0 = time.perf_counter()
    with Interference() as noise:
        outs = llm.generate(reqs, params, use_tqdm=use_tqdm)
    return outs, time.perf_counter() - t0, noise.result, start


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable-tqdm", action="store_true")
