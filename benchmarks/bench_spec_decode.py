#!/usr/bin/env python
"""Speculative decoding drafted from the KV cache: decode tokens/s with ngram, suffix and
draft_model drafting against no speculation, SmolLM2-135M (the embedded default model), batch
1, greedy.

draft_model drafts with SmolLM2 itself by default (--draft: another checkpoint of the same
tokenizer): every draft is the target's own greedy token, so every draft is accepted and the
run measures what a verification costs beside what the draft model costs. Its extra lines
give, per verification step, the decode time, the draft model's time, and the verification
overhead per drafted token: (step time - draft time - a plain one-token step) / drafts per
step. (Its requests carry a seed, which keeps them drafting where the speculator would stop
everyone's drafts for being slower than plain decoding: a draft as large as its target is.)

Workloads (the issue's):
  rewrite   a ~300-line Python file (kvserve/engine/audit.py, this repository's) to be rewritten
            whole with one change (a function renamed);
  document  a question answered from a ~1,500-token document (the manual's opening pages,
            docs/index.md and docs/offline_api.md: the README's opening sections until
            they moved there);
  chat      a 6-turn chat, each turn a new request carrying the whole conversation;
  random    random-token prompts (nothing repeats: speculation must cost next to nothing).

Decode tokens/s = (output tokens - 1) / (last token time - first token time), summed over the
workload's requests, so the prompt's prefill is left out. Each engine is built once per method
and runs every workload --repeats times; the table shows the median and its ratio to "off". The
same engine also checks that each method's greedy tokens equal "off"'s (the exactness claim).

    .venv/bin/python benchmarks/bench_spec_decode.py                  # ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_spec_decode.py --quick          # 64 tokens, 1 repeat
    .venv/bin/python benchmarks/bench_spec_decode.py --json out.json --k 4
    .venv/bin/python benchmarks/bench_spec_decode.py --load 64 --max-tokens 64  # throughput
    .venv/bin/python benchmarks/bench_spec_decode.py --methods off,draft_model --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.record import Row, add_record_arg, current_machine, ratio, write_record

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("off", "ngram", "suffix", "draft_model")


def _rewrite() -> list[list[dict]]:
    source = (ROOT / "kvserve" / "engine" / "audit.py").read_text()
    return [[{"role": "user", "content": "Rewrite this Python file, renaming the function "
              "`_sampled` to `_drawn` everywhere. Output the whole file and nothing else.\n\n"
              f"```python\n{source}```"}]]


def _document() -> list[list[dict]]:
    words = "\n".join((ROOT / "docs" / name).read_text()
                      for name in ("index.md", "offline_api.md")).split()
    doc = " ".join(words[:1100])  # about 1,500 tokens
    return [[{"role": "user", "content": f"Document:\n{doc}\n\nQuote, word for word, the "
              "paragraph of the document that describes the command line."}]]


def _chat(llm: LLM, params: SamplingParams) -> list[list[dict]]:
    """Six turns: each answer (computed off the clock, with the engine's own greedy output)
    goes back into the conversation, as a client would send it."""
    questions = ["What is a KV cache?", "Why are its blocks of fixed size?",
                 "Repeat your first answer, word for word.", "What is a prefix cache?",
                 "Summarise your answers so far.", "Repeat your summary, word for word."]
    conv: list[dict] = []
    convs = []
    for q in questions:
        conv = conv + [{"role": "user", "content": q}]
        convs.append(conv)
        answer = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
        conv = conv + [{"role": "assistant", "content": answer}]
    return convs


def _random(vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}
            for n in (200, 600)]


def _decode_time(outs) -> tuple[int, float]:
    """(tokens decoded after the first, seconds from the first token to the last)."""
    tokens, seconds = 0, 0.0
    for o in outs:
        m = o.metrics
        tokens += len(o.outputs[0].token_ids) - 1
        seconds += (m.last_token_time or 0.0) - (m.first_token_time or 0.0)
    return tokens, seconds


def _one(llm: LLM, prompts, params: SamplingParams, chat: bool
         ) -> tuple[float, list, float]:
    """(mean decode tokens/s, each request's tokens, decode seconds in all)."""
    rates, ids, total = [], [], 0.0
    for p in prompts:  # batch 1: one request at a time
        llm.engine.reset_prefix_cache()  # every request starts from a cold cache
        outs = llm.chat(p, params, use_tqdm=False) if chat else \
            llm.generate(p, params, use_tqdm=False)
        tokens, seconds = _decode_time(outs)
        rates.append(tokens / seconds if seconds > 0 else 0.0)
        ids.append(outs[0].outputs[0].token_ids)
        total += seconds
    return statistics.fmean(rates), ids, total


def _counts(before: dict, after: dict) -> tuple[int, int, int]:
    """(verifications, drafted tokens, accepted tokens) between two counter reads."""
    return tuple(after.get(k, 0) - before.get(k, 0)
                 for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))


def _acceptance(drafts: int, drafted: int, accepted: int) -> str:
    if not drafts:
        return "no drafts"
    return (f"{accepted}/{drafted} drafts accepted ({accepted / drafted:.0%}), "
            f"{(drafts + accepted) / drafts:.2f} tokens per verification")


def _ceiling(decoded: int, drafts: int, accepted: int, speedup: float) -> str:
    """What the acceptance allows and what a verification cost. With speculation the
    `decoded` tokens took decoded - accepted steps, `drafts` of them verifications: were a
    verification free (the cost of a one-row step), the speedup would be decoded / steps;
    the measured speedup then implies a verification's cost in one-row steps."""
    if not drafts:
        return ""
    steps = decoded - accepted
    cost = (decoded / speedup - (steps - drafts)) / drafts
    return (f"ceiling with free verification {decoded / steps:.2f}x; a verification cost "
            f"{cost:.2f} one-row steps")


def _overhead(runs: list, plain_step: float) -> str:
    """draft_model: per verification step (medians over the repeats), its decode time, the
    draft model's part, and what the verification costs beyond a plain one-token step, per
    drafted token: (step - draft - plain step) / drafts per step."""
    rows = []
    for r in runs:
        steps = r.decoded - r.accepted
        if r.drafts and steps > 0:
            step, draft = r.seconds / steps, r.draft_seconds / steps
            rows.append((step, draft, (step - draft - plain_step) / (r.drafted / r.drafts)))
    if not rows:
        return "no drafts"
    step, draft, per_token = (statistics.median(col) for col in zip(*rows))
    each = ", ".join(f"{row[2] * 1e3:.2f}" for row in rows)
    return (f"step {step * 1e3:.1f} ms, draft model {draft * 1e3:.1f} ms, plain step "
            f"{plain_step * 1e3:.1f} ms: verification overhead {per_token * 1e3:.2f} ms per "
            f"drafted token ({per_token / plain_step:.2f} plain steps; each repeat: {each})")


def _spec(method: str, k: int, draft: str | None = None, batch_limit: int | None = None
          ) -> dict | None:
    if method == "off":
        return None
    if method == "draft_model":
        from kvserve.model_loader.default import embedded_model_path

        spec = {"method": method, "num_speculative_tokens": k,
                "model": draft or str(embedded_model_path())}
        return spec if batch_limit is None else {**spec, "disable_by_batch_size": batch_limit}
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}


def _load(args: argparse.Namespace) -> None:
    """--load N: N distinct requests at once (the chat's six conversations, then random
    prompts of 100 to 400 tokens, each its own), output tokens per second of wall time over
    the whole batch, each method against off (the issue's acceptance 3: >= 0.97x). Distinct:
    copies of one prompt would give the suffix drafter the first copy's answer to draft."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts, rates = None, {}
    for method in args.methods:
        llm = LLM(speculative_config=_spec(method, args.k, args.draft, args.batch_limit),
                  max_model_len=8192)
        if prompts is None:
            tok = llm.engine.tokenizer
            chats = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
                c, add_generation_prompt=True), add_special_tokens=False)}
                for c in _chat(llm, SamplingParams(temperature=0.0, max_tokens=64))]
            rng, vocab = random.Random(1), llm.engine.model_config.vocab_size
            prompts = (chats + [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(
                rng.randrange(100, 400))]} for _ in range(args.load)])[:args.load]
        run_params = params if method != "draft_model" else SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)  # drafting
        for _ in range(args.repeats):
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, run_params, use_tqdm=False)
            seconds = time.perf_counter() - start
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.setdefault(method, []).append(made / seconds)
        print(f"{method:7s} load {args.load}: {statistics.median(rates[method]):7.1f} tok/s  "
              f"{llm.engine.stats().spec_decode}", flush=True)
        llm.engine.shutdown()
    off = statistics.median(rates["off"])
    print(f"\n{args.load} concurrent requests, output tokens/s (median of {args.repeats}): "
          + ", ".join(f"{m} {statistics.median(r):.1f} ({statistics.median(r) / off:.2f}x)"
                      for m, r in rates.items()))


@dataclass
class _Repeat:
    """One pass over a workload: decode tokens/s (the mean over its requests), the tokens
    decoded and their seconds, the speculation counters' and the drafter's time's growth."""

    rate: float
    ids: list
    decoded: int
    seconds: float
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0


def _repeat(llm: LLM, prompts, params: SamplingParams, chat: bool) -> _Repeat:
    spec = llm.engine.scheduler.spec
    before = llm.engine.stats().spec_decode
    drafting = spec.draft_seconds if spec is not None else 0.0
    rate, ids, seconds = _one(llm, prompts, params, chat)
    counts = _counts(before, llm.engine.stats().spec_decode)
    return _Repeat(rate, ids, sum(len(t) - 1 for t in ids), seconds, *counts,
                   (spec.draft_seconds - drafting) if spec is not None else 0.0)


def _median(runs: list[_Repeat], key) -> float:
    return statistics.median(key(r) for r in runs)


def _report(results: dict[str, dict[str, list[_Repeat]]], methods: list[str],
            args: argparse.Namespace) -> None:
    print(f"\ndecode tokens/s, SmolLM2-135M, batch 1, greedy, k={args.k}, "
          f"max_tokens={args.max_tokens}, median of {args.repeats}")
    print(f"{'workload':10s}" + "".join(f"{m:>18s}" for m in methods))
    for name, by_method in results.items():
        off = _median(by_method["off"], lambda r: r.rate)
        cells = []
        for m in methods:
            med = _median(by_method[m], lambda r: r.rate)
            same = "" if m == "off" else \
                (" =" if by_method[m][-1].ids == by_method["off"][-1].ids else " !=")
            cells.append(f"{med:8.1f} ({med / off:4.2f}x){same}")
        print(f"{name:10s}" + "".join(f"{c:>18s}" for c in cells))
    print("(=: greedy tokens equal to off's, !=: they differ)")
    for name, by_method in results.items():
        off = _median(by_method["off"], lambda r: r.rate)
        plain_step = _median(by_method["off"], lambda r: r.seconds / max(1, r.decoded))
        for m in methods[1:]:
            runs = by_method[m]
            decoded, drafts, accepted = (sum(getattr(r, f) for r in runs)
                                         for f in ("decoded", "drafts", "accepted"))
            if drafts:
                speedup = _median(runs, lambda r: r.rate) / off
                print(f"{name:10s}{m:12s}{_ceiling(decoded, drafts, accepted, speedup)}")
            if m == "draft_model":
                print(f"{name:10s}{m:12s}{_overhead(runs, plain_step)}")


# The targets (issue 49, acceptance 2): >= 1.8x on the first two tasks, >= 0.95x on
# random prompts; the chat has none.
TARGETS = {"rewrite": 1.8, "document": 1.8, "random": 0.95}


def _record(results: dict[str, dict[str, list[_Repeat]]], args: argparse.Namespace) -> None:
    """The figures page's record: each method's decode rate against off's, per workload."""
    rows = []
    for name, by_method in results.items():
        off = _median(by_method["off"], lambda r: r.rate)
        for m in args.methods[1:]:
            med = _median(by_method[m], lambda r: r.rate)
            target = TARGETS.get(name) if m != "draft_model" else None
            same = by_method[m][-1].ids == by_method["off"][-1].ids
            rows.append(Row(f"{name}, {m} (greedy tokens {'equal' if same else 'DIFFER'})",
                            "tok/s", round(med, 1), round(off, 1), ratio(med, off),
                            None if target is None else f">= {target}x",
                            None if target is None else med >= target * off))
    write_record(args.record, name="bench-spec-decode-" + "-".join(args.methods[1:]), rows=rows,
                 title=f"Batch-1 decode with speculation, SmolLM2-135M GGUF, k={args.k}",
                 peer="none: kvserve against itself (speculation off / on)",
                 notes=f"max_tokens {args.max_tokens}, medians of {args.repeats}.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--load", type=int, default=0,
                    help="N concurrent requests: throughput instead of batch-1 decode speed")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated, 'off' first (default: all)")
    ap.add_argument("--draft", default=None,
                    help="draft_model's checkpoint (default: SmolLM2 itself)")
    ap.add_argument("--batch-limit", type=int, default=None,
                    help="draft_model's disable_by_batch_size (--load: where drafting stops)")
    ap.add_argument("--workloads", default="rewrite,document,chat,random",
                    help="which of the workloads to run (comma-separated)")
    add_record_arg(ap, "spec-decode")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    assert args.methods[0] == "off" and set(args.methods) <= set(METHODS), args.methods
    if args.quick:
        args.max_tokens, args.repeats = 64, 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"{current_machine()}; torch threads: {torch.get_num_threads()}", flush=True)
    if args.load:
        _load(args)
        return
    results: dict[str, dict[str, list[_Repeat]]] = {}
    workloads = None
    for method in args.methods:
        llm = LLM(speculative_config=_spec(method, args.k, args.draft), max_model_len=8192)
        if workloads is None:  # the chat's turns come from the reference engine's answers
            vocab = llm.engine.model_config.vocab_size
            make = {"rewrite": lambda: (_rewrite(), True), "document": lambda: (_document(), True),
                    "chat": lambda: (_chat(llm, params), True),
                    "random": lambda: (_random(vocab), False)}
            workloads = {name: make[name]() for name in args.workloads.split(",")}
        # (greedy either way; a seed keeps the draft model's requests drafting, see above)
        run_params = params if method != "draft_model" else \
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
        for name, (prompts, chat) in workloads.items():
            runs = results.setdefault(name, {}).setdefault(method, [])
            for _ in range(args.repeats):
                runs.append(_repeat(llm, prompts, run_params, chat))
            last = runs[-1]
            print(f"{method:11s} {name:9s} {_median(runs, lambda r: r.rate):7.1f} tok/s  "
                  f"{_acceptance(last.drafts, last.drafted, last.accepted)}", flush=True)
        llm.engine.shutdown()
    _report(results, args.methods, args)
    if args.record:
        _record(results, args)
    if args.json:
        args.json.write_text(json.dumps({
            "results": {n: {m: [r.rate for r in runs] for m, runs in by.items()}
                        for n, by in results.items()},
            "k": args.k, "max_tokens": args.max_tokens, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
