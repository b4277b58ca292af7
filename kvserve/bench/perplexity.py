"""`kvserve bench perplexity`: a model's perplexity on text, as `llama-perplexity` measures it.

The model is a checkpoint directory or a GGUF file; the scores are the engine's prompt logprobs:
the text
(--files; default: the held-out split of this Python's standard library) is one token stream cut
into non-overlapping windows of --context tokens, --max-tokens in all, and every token but a
window's first is scored (kvserve.eval.perplexity). --compare-transformers scores the same
windows through transformers on the same checkpoint (float32: they agree within 1e-3);
--baselines adds a unigram model of the training split and the random-weight model of the same
shape, the figures a trained model must beat."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvserve.bench import offline, results
from kvserve.bench.record import Row, add_record_arg, ratio, write_record
from kvserve.eval.heldout import stdlib_files
from kvserve.layers.selection import resolve_dtype
from kvserve.eval.perplexity import (NLL, corpus_tokens, engine_nll, llm_nll, random_weight_copy,
                                     relative_difference, transformers_nll, unigram_nll, windows)


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--files", nargs="+", type=Path, default=None,
                   help="text files to score (default: the stdlib's held-out split)")
    p.add_argument("--max-tokens", type=int, default=32768, help="token budget over all windows")
    p.add_argument("--context", type=int, default=512, help="tokens per window (llama.cpp: -c)")
    p.add_argument("--compare-transformers", action="store_true",
                   help="the same windows through transformers (a checkpoint directory only)")
    p.add_argument("--baselines", action="store_true",
                   help="a unigram model of the training split and the random-weight model")
    p.add_argument("--baseline-seed", type=int, default=0,
                   help="seed of the random-weight baseline")
    offline.add_common_args(p)
    results.add_result_args(p, "(no plot)")
    add_record_arg(p, "accuracy")


def evaluate(llm, files: list[Path], max_tokens: int, context: int, compare_transformers: bool
             = False, baselines: bool = False, seed: int = 0, use_tqdm: bool = True,
             train_files: list[Path] | None = None) -> dict[str, NLL]:
    """NLL per evaluator over the same windows: "kvserve" (through `llm`) always, then
    "transformers", "unigram (train split)" (counted over `train_files`, default the stdlib's
    training split) and "random-weight (kvserve)" as asked."""
    tokenizer = llm.get_tokenizer()
    wins = windows(corpus_tokens(tokenizer, files, max_tokens), context)
    if not wins:
        raise ValueError("the files hold fewer than 2 tokens: nothing to score")
    config = llm.engine.config
    model = str(config.model)
    # the dtype the engine runs ("auto" resolved as the engine resolves it), for transformers
    dtype = str(resolve_dtype(config.dtype, llm.engine.model_config, config.device))
    dtype = dtype.removeprefix("torch.")
    out = {"kvserve": llm_nll(llm, wins, use_tqdm)}
    if compare_transformers:
        if not Path(model).is_dir():
            raise ValueError(f"--compare-transformers needs a checkpoint directory, not {model}")
        out["transformers"] = transformers_nll(model, wins, dtype, use_tqdm)
    if baselines:
        train = corpus_tokens(tokenizer, train_files or stdlib_files("train"))
        out["unigram (train split)"] = unigram_nll(train, len(tokenizer), wins)
        with tempfile.TemporaryDirectory(prefix="kvserve-random-") as tmp:
            out["random-weight (kvserve)"] = engine_nll(random_weight_copy(model, tmp, seed),
                                                        wins, dtype, use_tqdm)
    return out


def table(res: dict[str, NLL]) -> str:
    ref = res.get("transformers")
    lines = [f"{'model':<26} {'tokens':>8} {'nll/token':>10} {'perplexity':>12} "
             f"{'rel. diff vs transformers':>26}"]
    for name, nll in res.items():
        diff = "" if ref is None or name not in ("kvserve", "transformers") \
            else f"{relative_difference(nll.perplexity, ref.perplexity):.2e}"
        lines.append(f"{name:<26} {nll.tokens:>8} {nll.per_token:>10.4f} "
                     f"{nll.perplexity:>12.3f} {diff:>26}")
    return "\n".join(lines)


def record(args: argparse.Namespace, model: str, res: dict[str, NLL]) -> None:
    """The figures page's record: the perplexity beside transformers' on the same windows
    (where compared) and beside the unigram baseline (a model must beat it)."""
    ours, ref = res["kvserve"], res.get("transformers")
    name = Path(model).name
    rows = [Row(f"{name}, held-out perplexity", "", round(ours.perplexity, 3),
                None if ref is None else round(ref.perplexity, 3),
                None if ref is None else ratio(ours.perplexity, ref.perplexity))]
    if "unigram (train split)" in res:
        uni = res["unigram (train split)"].perplexity
        rows.append(Row(f"{name} against a unigram model of the training split (peer: the "
                        "unigram)", "", round(ours.perplexity, 3), round(uni, 3),
                        ratio(ours.perplexity, uni), "< 1x", ours.perplexity < uni))
    write_record(args.record, name="bench-ppl", rows=rows,
                 title=f"Held-out perplexity through the engine, {name}",
                 peer="transformers on the same checkpoint" if ref else "none",
                 notes=f"{ours.tokens:,} scored tokens in windows of {args.context}.")


def run(args: argparse.Namespace) -> dict:
    if args.context < 2:
        raise ValueError(f"--context must be at least 2 tokens, not {args.context}")
    llm, _ = offline.load_llm(args, max_model_len=args.context + 1,
                              max_num_batched_tokens=args.max_num_batched_tokens
                              or max(2048, args.context + 1))
    files = args.files or stdlib_files("heldout")
    start = time.perf_counter()
    try:
        res = evaluate(llm, files, args.max_tokens, args.context, args.compare_transformers,
                       args.baselines, args.baseline_seed, not args.disable_tqdm)
    finally:
        llm.engine.shutdown()
    model = str(llm.engine.config.model)
    print(f"model {model}; {len(files)} files, context {args.context}, "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(table(res))
    if args.record:
        record(args, model, res)
    out = {"model": model, "files": [str(f) for f in files], "context": args.context,
           "max_tokens": args.max_tokens,
           "results": {name: {"tokens": r.tokens, "nll_total": r.total,
                              "nll_per_token": r.per_token, "perplexity": r.perplexity}
                       for name, r in res.items()}}
    results.finish(args, out, "perplexity")
    return out
