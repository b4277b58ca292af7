"""What deterministic inference costs (issue 64): the same engine with `deterministic` off and
on, alternated in one process, on the same prompts.

Figures: prefill (a fresh prompt of 512 and of 2,048 tokens, one token out: its time to first
token), batch-1 decode (128 tokens after a 64-token prompt) and batch 32 (32 x 128 -> 128, the
throughput benchmark's shape). Each repeat runs off then on (then on then off: the order
alternates), medians of the repeats; the ratio is on / off (time: lower is better, so the
cost is ratio - 1; rates: on / off).

    .venv/bin/python benchmarks/bench_deterministic.py --repeats 5 --record
    .venv/bin/python benchmarks/bench_deterministic.py --model ~/.cache/kvserve/gguf-models/llama-3.2-1b/Q4_K_M.gguf
    KVSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_deterministic.py

Never beside another job: on 2 cores a second process slows both many times over.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.record import Row, add_record_arg, current_machine, ratio, write_record


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(n)]


def _timed(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - started


def measure(llm: LLM, vocab: int, seed: int, workloads: list[str]) -> dict[str, float]:
    """One repeat's figures: seconds for prefills, tok/s for decodes."""
    out = {}
    for length in (512, 2048):
        if f"prefill{length}" in workloads:
            out[f"prefill{length}"] = _timed(llm, _prompts(1, length, vocab, seed + length), 1)
    if "batch1" in workloads:
        p = _prompts(1, 64, vocab, seed)
        first = _timed(llm, p, 1)
        out["batch1"] = 127 / (_timed(llm, _prompts(1, 64, vocab, seed + 1), 128) - first)
    if "batch32" in workloads:
        out["batch32"] = 32 * 128 / _timed(llm, _prompts(32, 128, vocab, seed), 128)
    return out


FIGURES = {"prefill512": ("prefill, a fresh 512-token prompt", "s"),
           "prefill2048": ("prefill, a fresh 2,048-token prompt", "s"),
           "batch1": ("batch-1 decode, 64 -> 128", "tok/s"),
           "batch32": ("batch 32, 32 x 128 -> 128", "tok/s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 Q4_1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workloads", default=",".join(FIGURES))
    add_record_arg(ap, "deterministic")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    print(current_machine(), f"| {torch.get_num_threads()} threads", flush=True)
    engines = {d: LLM(model=args.model, deterministic=d, enable_prefix_caching=False,
                      max_model_len=4096, seed=0) for d in (False, True)}
    vocab = min(engines[False].engine.model_config.vocab_size, 32000)
    for llm in engines.values():  # warm both: kernels built, crossovers measured, pages in
        measure(llm, vocab, 0, ["prefill512", "batch1"])
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(args.repeats):
        for d in ((False, True) if r % 2 == 0 else (True, False)):
            gc.collect()
            runs[d].append(measure(engines[d], vocab, 1000 * (r + 1), workloads))
            print(f"repeat {r} {'on ' if d else 'off'}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in runs[d][-1].items()), flush=True)
    rows = []
    print(f"\n{'figure':<40} {'off':>10} {'on':>10} {'on/off':>8}")
    for key in workloads:
        off = statistics.median(x[key] for x in runs[False])
        on = statistics.median(x[key] for x in runs[True])
        name, unit = FIGURES[key]
        print(f"{name:<40} {off:>10.3f} {on:>10.3f} {on / off:>7.3f}x")
        rows.append(Row(name, unit, round(on, 4), round(off, 4), ratio(on, off)))
    if args.record:
        # a GGUF made by benchmarks.lab.gguf_models is <shape>/<TYPE>.gguf: name both
        model = f"{Path(args.model).parent.name}/{Path(args.model).name}" if args.model \
            else "SmolLM2-135M Q4_1 (embedded)"
        stem = f"{Path(args.model).parent.name}-{Path(args.model).stem}" if args.model \
            else "smollm2"
        isa = os.environ.get("KVSERVE_CPU_ISA", "native")
        write_record(args.record, rows=rows,
                     name=f"bench-deterministic-{stem}-{isa}".lower().replace("_", "-")
                     .replace(".", "-"),
                     title=f"deterministic on against off: {model}, {isa} kernels",
                     peer="kvserve with deterministic off (the same process, alternated)",
                     notes=f"medians of {args.repeats} alternated repeats; kvserve column: "
                           "deterministic on; ratio on / off (prefill: seconds, lower is "
                           "better; decode: tok/s, higher is better)")


if __name__ == "__main__":
    main()
