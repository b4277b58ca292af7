#!/usr/bin/env python
"""Quantized KV cache (issue 14): accuracy on the trained model, capacity, and decode speed.

  accuracy  stdlib-coder on its held-out split (kvserve/eval/heldout.py), every KV dtype
            against the unquantized cache: perplexity over non-overlapping windows of
            --context tokens, mean KL(P_unquantized || P_dtype) of the next-token
            distributions at every position, and greedy agreement over --continuation-token
            continuations of --num-prompts held-out prompts (tokens equal, position by position;
            the mean share before the first difference; the share of prompts identical).
  capacity  tokens in one fixed pool per dtype: the engine's pool, `kvserve plan`'s figure.
  speed     decode throughput per dtype vs auto, measured side by side in one run (engines
            interleaved round by round, medians): batch --batch x --prompt-len random
            tokens, and --long-batch x --long-context tokens (where reading less KV may pay).
  attention the same two shapes, one layer's decode attention alone (the dequant cost).

The full-vocabulary distributions come from the engine's own prompt logprobs path: the runner's
prompt-logit rows (what SamplingParams.prompt_logprobs is computed from), tapped per step.

    .venv/bin/python benchmarks/bench_kv_quant.py accuracy [--max-tokens 32768] [--json F]
    .venv/bin/python benchmarks/bench_kv_quant.py capacity
    .venv/bin/python benchmarks/bench_kv_quant.py speed [--rounds 5] [--dtype bfloat16]
    .venv/bin/python benchmarks/bench_kv_quant.py attention --rounds 21
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

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
        execute = runner.execute

        def tapped(batch):
            out = execute(batch)
            at = 0
            for span in out.prompt_spans:
                rid = batch.requests[span.batch_index].request_id
                rows = out.prompt_logits[at:at + span.count]
                self.rows.setdefault(rid, []).append(
                    (span.first_token, torch.log_softmax(rows.float(), -1)))
                at += span.count
            return out

        runner.execute = tapped

    def take(self, rid: str) -> torch.Tensor:
        """[prompt_len - 1, vocab]: row i predicts prompt token i + 1."""
        parts = sorted(self.rows.pop(rid), key=lambda p: p[0])
        return torch.cat([p[1] for p in parts])


def make_llm(model: str, dtype: str, max_model_len: int, **kwargs):
    from kvserve import LLM

    return LLM(model=model, dtype=dtype, max_model_len=max_model_len,
               max_num_batched_tokens=2048, kv_cache_memory_bytes=256 * 2**20,
               enable_prefix_caching=False, **kwargs)


# -- accuracy -------------------------------------------------------------------------------
def accuracy(args) -> dict:
    from kvserve import SamplingParams
    from kvserve.eval.heldout import stdlib_files
    from kvserve.eval.perplexity import corpus_tokens, windows
    from kvserve.tokenizer import Tokenizer

    model = args.model or str(REPO / "kvserve" / "models" / "stdlib-coder")
    tok = Tokenizer.from_dir(model)
    ids = corpus_tokens(tok, stdlib_files("heldout"), args.max_tokens)
    wins = windows(ids, args.context)
    names = [n for n in CONFIGS if n in args.only] if args.only else list(CONFIGS)
    llms = {n: make_llm(model, args.dtype, args.context + args.continuation + 1, **CONFIGS[n])
            for n in names}
    taps = {n: LogitsTap(llm) for n, llm in llms.items()}
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in names}
    count = 0
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    t0 = time.time()
    for g in range(0, len(wins), args.group):
        group = wins[g:g + args.group]
        logp = {}
        for n, llm in llms.items():
            outs = llm.generate([{"prompt_token_ids": w} for w in group], score, use_tqdm=False)
            logp[n] = [taps[n].take(o.request_id) for o in outs]
        for i, w in enumerate(group):
            target = torch.tensor(w[1:])
            base = logp["auto"][i]
            for n in names:
                lp = logp[n][i]
                nll[n] -= float(lp.gather(1, target[:, None]).double().sum())
                kl[n] += float((base.exp() * (base - lp)).sum(-1).double().sum())
            count += len(w) - 1
        print(f"  {g + len(group)}/{len(wins)} windows, {time.time() - t0:.0f} s",
              file=sys.stderr)
    # greedy continuations of held-out prompts
    starts = [w[:args.prompt_len] for w in wins if len(w) >= args.prompt_len][:args.num_prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.continuation, ignore_eos=True,
                            detokenize=False)
    conts = {n: [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in starts], greedy, use_tqdm=False)]
        for n, llm in llms.items()}
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
                       mean_kl=kl[n] / count, greedy_token_agreement=statistics.mean(same),
                       greedy_prefix_agreement=statistics.mean(prefix),
                       greedy_identical=exact / len(starts), **CONFIGS[n])
    print(machine())
    print(f"model {model} ({args.dtype}), held-out split: {len(wins)} windows of {args.context} "
          f"tokens, {count:,} predicted tokens; greedy: {len(starts)} prompts of "
          f"{args.prompt_len} tokens -> {args.continuation} tokens")
    print(f"{'kv cache':<24}{'ppl':>9}{'change':>9}{'mean KL':>11}{'greedy tok':>12}"
          f"{'prefix':>9}{'identical':>11}")
    for n, r in rows.items():
        print(f"{n:<24}{r['ppl']:>9.3f}{r['ppl_change_pct']:>+8.3f}%{r['mean_kl']:>11.2e}"
              f"{100 * r['greedy_token_agreement']:>11.1f}%{100 * r['greedy_prefix_agreement']:>8.1f}%"
              f"{100 * r['greedy_identical']:>10.1f}%")
    for llm in llms.values():
        llm.engine.shutdown()
    return {"machine": machine(), "windows": len(wins), "predicted_tokens": count,
            "context": args.context, "rows": rows}


# -- capacity -------------------------------------------------------------------------------
def capacity(args) -> dict:
    from kvserve import LLM
    from kvserve.planner import make_plan
    from kvserve.planner.model import ModelSpec

    model = args.model or str(REPO / "kvserve" / "models" / "stdlib-coder")
    spec = ModelSpec.load(str(Path(model) / "config.json"))
    budget = args.pool_bytes
    rows = {}
    for name in ("bf16", "fp8", "fp8_e5m2", "int8", "int4"):
        llm = LLM(model=model, dtype="bfloat16", kv_cache_dtype=name, block_size=16,
                  max_model_len=2048, kv_cache_memory_bytes=budget)
        tokens = llm.engine.kv.num_blocks * 16
        plan = make_plan(spec, kv_dtype=name, context_len=2048, kv_cache_memory=budget,
                         block_size=16)
        rows[name] = {"tokens": tokens, "plan_tokens": plan["capacity"]["kv_cache_tokens"],
                      "bytes_per_token": llm.engine.kv_spec.bytes_per_token,
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

    model = args.model or str(ensure_checkpoint(cache_dir() / "bench-qwen2-small", 1200))
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
    from kvserve.model.attention.base import AttentionMetadata, SequenceSlice
    from kvserve.model.attention.torch_backend import TorchAttentionBackend

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
    p.add_argument("--model", default=None)
    p.add_argument("--only", nargs="+", default=None, help="a subset of the dtypes/configs")
    p.add_argument("--dtype", default=None, help="model dtype (accuracy: float32; speed: "
                   "bfloat16 where the CPU has avx512_bf16, else float32)")
    p.add_argument("--json", type=Path, default=None)
    a = p.add_argument_group("accuracy")
    a.add_argument("--max-tokens", type=int, default=32768)
    a.add_argument("--context", type=int, default=256)
    a.add_argument("--group", type=int, default=16, help="windows per engine call")
    a.add_argument("--num-prompts", type=int, default=32)
    a.add_argument("--prompt-len", type=int, default=128)
    a.add_argument("--continuation", type=int, default=128)
    c = p.add_argument_group("capacity / speed")
    c.add_argument("--pool-bytes", type=int, default=None)
    c.add_argument("--batch", type=int, default=64)
    c.add_argument("--long-batch", type=int, default=8)
    c.add_argument("--long-context", type=int, default=4096)
    c.add_argument("--steps", type=int, default=8)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "accuracy":
        args.dtype = args.dtype or "float32"
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
        result = speed(args) if args.what == "speed" else attention(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
