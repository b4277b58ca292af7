#!/usr/bin/env python
"""Structured-output overhead: a batch with 25% grammar-constrained requests against the same
batch with none, side by side in one run (alternating, medians of --repeats).

Every request has the same prompt length and generates exactly --max-tokens tokens (the
constrained ones follow a regex that cannot end sooner), so both batches do the same model
work and differ only in the grammar: bitmask fills on the engine thread and the masked rows in
the sampler. Reported: end-to-end output tokens/s of each batch, the median engine step time
(every row of a step, constrained or not, waits for the same step: that is the per-token time
of both kinds of row), and the median time per step spent on grammars (filling bitmasks,
accepting tokens) and in the sampler. Then the sampler alone (no model, so the shared
machine's noise matters less): a [batch, vocab] step with no bitmask vs 25% of the rows masked,
greedy and random, interleaved, median of --sampler-iters calls.

    .venv/bin/python benchmarks/bench_structured.py [--model DIR] [--batch 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.structured import StructuredOutputsParams  # noqa: E402

REGEX = "[a-z ]{400}"  # longer than any run here: constrained requests run to max_tokens


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


class Timers:
    """Wraps the engine's grammar work and its sampler to time them per step."""

    def __init__(self, llm: LLM) -> None:
        self.sampler: list[float] = []
        self.rows: list[float] = []
        engine = llm.engine
        sampling = engine.runner.sampling  # the worker's sampler
        sampler = sampling.sampler
        original_rows = engine.scheduler._grammar_bitmask  # the step's bitmask rows

        def timed_sampler(logits, rows, token_bitmask=None):
            t = time.perf_counter()
            out = sampler(logits, rows, token_bitmask)
            self.sampler.append(time.perf_counter() - t)
            return out

        def timed_rows(batch):
            t = time.perf_counter()
            out = original_rows(batch)
            self.rows.append(time.perf_counter() - t)
            return out

        sampling.sampler = timed_sampler
        engine.scheduler._grammar_bitmask = timed_rows


def run(llm: LLM, timers: Timers, batch: int, constrained: int, prompt_len: int,
        max_tokens: int, seed: int) -> dict:
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    so = StructuredOutputsParams(regex=REGEX)
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                             ignore_eos=True,
                             structured_outputs=so if i % (batch // max(constrained, 1)) == 0
                             and i // (batch // max(constrained, 1)) < constrained else None)
              for i in range(batch)]
    assert sum(p.structured_outputs is not None for p in params) == constrained
    llm.engine.grammars.compile(so)  # compiled once, outside the timing (it is cached)
    timers.sampler.clear()
    timers.rows.clear()
    steps: list[float] = []
    original_step = llm.engine.step

    def timed_step():
        t = time.perf_counter()
        out = original_step()
        steps.append(time.perf_counter() - t)
        return out

    llm.engine.step = timed_step
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    llm.engine.step = original_step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == batch * max_tokens, tokens
    for o, p in zip(outs, params):
        if p.structured_outputs is not None:
            assert set(o.outputs[0].text) <= set("abcdefghijklmnopqrstuvwxyz "), o.outputs[0].text
    decode = steps[len(steps) // 4:]  # past the prefill steps
    return {"tok_s": tokens / wall, "step_ms": 1e3 * statistics.median(decode),
            "sampler_ms": 1e3 * statistics.median(timers.sampler),
            "grammar_ms": 1e3 * statistics.median(timers.rows)}


def sampler_only(batch: int, constrained: int, vocab: int, temperature: float,
                 iters: int) -> tuple[float, float]:
    """Median ms of one Sampler call without and with `constrained` masked rows."""
    from kvserve.sampler import Sampler, SamplingRow

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (constrained, words), generator=g,
                            dtype=torch.int32)
    params = SamplingParams(temperature=temperature)
    plain = [SamplingRow(params) for _ in range(batch)]
    masked = [SamplingRow(params, bitmask_row=i if i < constrained else None)
              for i in range(batch)]
    sampler = Sampler(seed=0)
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    for i in range(iters):
        for name in (("plain", "masked") if i % 2 == 0 else ("masked", "plain")):
            rows = plain if name == "plain" else masked
            t = time.perf_counter()
            sampler(logits, rows, bitmask if name == "masked" else None)
            times[name].append(time.perf_counter() - t)
    return 1e3 * statistics.median(times["plain"]), 1e3 * statistics.median(times["masked"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the shipped stdlib-coder")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampler-iters", type=int, default=300)
    p.add_argument("--sampler-threads", type=int, default=1,
                   help="torch threads for the sampler-alone part (1: on a shared 2-core "
                        "machine, waking a second thread costs more than the work)")
    p.add_argument("--sampler-only", action="store_true", help="skip the engine runs")
    args = p.parse_args()
    print(cpu_line())
    constrained = round(args.batch * args.fraction)
    if not args.sampler_only:
        engine_runs(args, constrained)
    torch.set_num_threads(args.sampler_threads)
    print(f"\nsampler alone, {args.batch} rows, {constrained} masked (median of "
          f"{args.sampler_iters} interleaved calls, {args.sampler_threads} torch threads):")
    print(f"{'vocab':>7} {'rows':<7} {'no mask ms':>11} {'masked ms':>10} {'ratio':>6}")
    for vocab in (8192, 32000):
        for temperature, label in ((0.0, "greedy"), (1.0, "random")):
            plain, masked = sampler_only(args.batch, constrained, vocab, temperature,
                                         args.sampler_iters)
            print(f"{vocab:>7} {label:<7} {plain:>11.3f} {masked:>10.3f} {masked / plain:>6.2f}")
    return 0


def engine_runs(args: argparse.Namespace, constrained: int) -> None:
    llm = LLM(model=args.model, seed=0, max_num_seqs=args.batch, dtype="float32")
    timers = Timers(llm)
    print(f"model {llm.engine.config.model}, vocab {llm.engine.model_config.vocab_size}; "
          f"batch {args.batch} x ({args.prompt_len} prompt -> {args.max_tokens} new), "
          f"{constrained} constrained by regex {REGEX!r}")
    results: dict[str, list[dict]] = {"none": [], "constrained": []}
    run(llm, timers, args.batch, 0, args.prompt_len, 8, seed=99)  # warm-up
    for r in range(args.repeats):
        order = ("none", "constrained") if r % 2 == 0 else ("constrained", "none")
        for name in order:
            results[name].append(run(llm, timers, args.batch,
                                     constrained if name == "constrained" else 0,
                                     args.prompt_len, args.max_tokens, seed=r))
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for name, rs in results.items()}
    print(f"\n{'batch':<24} {'tok/s':>8} {'step ms':>8} {'sampler ms':>11} {'grammar ms':>11}")
    for name, m in med.items():
        label = "no grammar" if name == "none" else f"{constrained}/{args.batch} constrained"
        print(f"{label:<24} {m['tok_s']:>8.1f} {m['step_ms']:>8.2f} {m['sampler_ms']:>11.3f} "
              f"{m['grammar_ms']:>11.3f}")
    ratio = med["constrained"]["step_ms"] / med["none"]["step_ms"]
    print(f"\nthroughput constrained/none: "
          f"{med['constrained']['tok_s'] / med['none']['tok_s']:.3f}x; decode step time "
          f"(= per-token time of every row, constrained or not) constrained/none: {ratio:.3f}x")


if __name__ == "__main__":
    raise SystemExit(main())
