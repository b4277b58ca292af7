#!/usr/bin/env python
"""Held-out perplexity of a model through the kvserve engine (its prompt logprobs).

By default the text is the held-out split of the running Python's standard library
(`kvserve.eval.heldout`: ~5% of its .py files chosen by a hash of their path), cut into
non-overlapping windows of --context tokens, --max-tokens in all. Prints a table and, with
--json, writes the figures.

  --compare-transformers  the same windows through transformers (same weights): both NLLs and
                          their relative difference (float32: they agree within 1e-3)
  --baselines             a unigram model of the training split's tokens (add-one smoothing)
                          and the random-weight model of the same shape (the config
                          re-initialised by transformers with --seed), both through the same
                          windows; the second through the engine too

    .venv/bin/python benchmarks/bench_ppl.py --model DIR --compare-transformers --baselines
    .venv/bin/python benchmarks/bench_ppl.py --files a.txt b.txt --context 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kvserve.eval.heldout import stdlib_files
from kvserve.eval.perplexity import (NLL, corpus_tokens, engine_nll, random_weight_copy,
                                     relative_difference, transformers_nll, unigram_nll, windows)
from kvserve.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="an HF-format checkpoint directory (default: the engine's default model)")
    p.add_argument("--files", nargs="+", type=Path, default=None,
                   help="text files to score (default: the stdlib's held-out split)")
    p.add_argument("--max-tokens", type=int, default=32768, help="token budget over all windows")
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine step size (bounds the [tokens, vocab] prompt-logit tensor)")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--baselines", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-weight baseline")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def evaluate(model: str, files: list[Path], max_tokens: int, context: int,
             dtype: str = "float32", compare_transformers: bool = False, baselines: bool = False,
             seed: int = 0, train_files: list[Path] | None = None, use_tqdm: bool = True,
             **engine_kwargs) -> dict[str, NLL]:
    """NLL per evaluator over the same windows: "kvserve" always, then "transformers",
    "unigram (train split)" (counted over `train_files`, default the stdlib's training split)
    and "random-weight (kvserve)" as asked."""
    tokenizer = Tokenizer.from_dir(model)
    wins = windows(corpus_tokens(tokenizer, files, max_tokens), context)
    if not wins:
        raise ValueError("the files hold fewer than 2 tokens: nothing to score")
    results = {"kvserve": engine_nll(model, wins, dtype, use_tqdm, **engine_kwargs)}
    if compare_transformers:
        results["transformers"] = transformers_nll(model, wins, dtype, use_tqdm)
    if baselines:
        train = corpus_tokens(tokenizer, train_files or stdlib_files("train"))
        results["unigram (train split)"] = unigram_nll(train, len(tokenizer), wins)
        with tempfile.TemporaryDirectory(prefix="kvserve-random-") as tmp:
            random_dir = random_weight_copy(model, tmp, seed)
            results["random-weight (kvserve)"] = engine_nll(random_dir, wins, dtype, use_tqdm,
                                                            **engine_kwargs)
    return results


def table(results: dict[str, NLL]) -> str:
    ref = results.get("transformers")
    lines = [f"{'model':<26} {'tokens':>8} {'nll/token':>10} {'perplexity':>12} "
             f"{'rel. diff vs transformers':>26}"]
    for name, nll in results.items():
        diff = "" if ref is None or name not in ("kvserve", "transformers") \
            else f"{relative_difference(nll.perplexity, ref.perplexity):.2e}"
        lines.append(f"{name:<26} {nll.tokens:>8} {nll.per_token:>10.4f} "
                     f"{nll.perplexity:>12.3f} {diff:>26}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from kvserve.model_loader.make_model import ensure_default_model

        args.model = str(ensure_default_model())
    files = args.files or stdlib_files("heldout")
    start = time.time()
    results = evaluate(args.model, files, args.max_tokens, args.context, args.dtype,
                       args.compare_transformers, args.baselines, args.seed,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"model {args.model}; {len(files)} files, context {args.context}, "
          f"{args.dtype}, {time.time() - start:.1f} s", file=sys.stderr)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": args.model, "files": [str(f) for f in files], "context": args.context,
            "max_tokens": args.max_tokens, "dtype": args.dtype,
            "results": {name: {"tokens": r.tokens, "nll_total": r.total,
                               "nll_per_token": r.per_token, "perplexity": r.perplexity}
                        for name, r in results.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
