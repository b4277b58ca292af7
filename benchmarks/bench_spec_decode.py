#!/usr/bin/env python
"""Speculative decoding drafted from the KV cache: decode tokens/s with ngram and suffix
drafting against no speculation, SmolLM2-135M (the embedded default model), batch 1, greedy.

Workloads (the issue's):
  rewrite   a ~300-line Python file (kvserve/engine/audit.py, this repository's) to be rewritten
            whole with one change (a function renamed);
  document  a question answered from a ~1,500-token document (the README's opening sections);
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
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("off", "ngram", "suffix")


def _rewrite() -> list[list[dict]]:
    source = (ROOT / "kvserve" / "engine" / "audit.py").read_text()
    return [[{"role": "user", "content": "Rewrite this Python file, renaming the function "
              "`_sampled` to `_drawn` everywhere. Output the whole file and nothing else.\n\n"
              f"```python\n{source}```"}]]


def _document() -> list[list[dict]]:
    words = (ROOT / "README.md").read_text().split()
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


def _decode_rate(outs) -> tuple[float, list[list[int]]]:
    tokens = seconds = 0.0
    for o in outs:
        m = o.metrics
        tokens += len(o.outputs[0].token_ids) - 1
        seconds += (m.last_token_time or 0.0) - (m.first_token_time or 0.0)
    return tokens / seconds if seconds > 0 else 0.0, [o.outputs[0].token_ids for o in outs]


def _one(llm: LLM, prompts, params: SamplingParams, chat: bool) -> tuple[float, list]:
    rates, ids = [], []
    for p in prompts:  # batch 1: one request at a time
        llm.engine.reset_prefix_cache()  # every request starts from a cold cache
        outs = llm.chat(p, params, use_tqdm=False) if chat else \
            llm.generate(p, params, use_tqdm=False)
        rates.append(_decode_rate(outs)[0])
        ids.append(outs[0].outputs[0].token_ids)
    return statistics.fmean(rates), ids


def _cpu() -> str:
    """The CPU's model name and the SIMD flags the kernels' builds choose from."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx"))]
    return f"{name}; {' '.join(simd)}"


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


def _spec(method: str, k: int) -> dict | None:
    return None if method == "off" else {
        "method": method, "num_speculative_tokens": k, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


def _load(args: argparse.Namespace) -> None:
    """--load N: N distinct requests at once (the chat's six conversations, then random
    prompts of 100 to 400 tokens, each its own), output tokens per second of wall time over
    the whole batch, each method against off (the issue's acceptance 3: >= 0.97x). Distinct:
    copies of one prompt would give the suffix drafter the first copy's answer to draft."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts, rates = None, {}
    for method in METHODS:
        llm = LLM(speculative_config=_spec(method, args.k), max_model_len=8192)
        if prompts is None:
            tok = llm.engine.tokenizer
            chats = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
                c, add_generation_prompt=True), add_special_tokens=False)}
                for c in _chat(llm, SamplingParams(temperature=0.0, max_tokens=64))]
            rng, vocab = random.Random(1), llm.engine.model_config.vocab_size
            prompts = (chats + [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(
                rng.randrange(100, 400))]} for _ in range(args.load)])[:args.load]
        for _ in range(args.repeats):
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--load", type=int, default=0,
                    help="N concurrent requests: throughput instead of batch-1 decode speed")
    ap.add_argument("--workloads", default="rewrite,document,chat,random",
                    help="which of the workloads to run (comma-separated)")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 64, 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"CPU: {_cpu()}; torch threads: {torch.get_num_threads()}", flush=True)
    if args.load:
        _load(args)
        return
    results: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, dict[str, list]] = {}
    counts: dict[tuple[str, str], tuple[int, int, int, int]] = {}  # decoded, drafts, ...
    workloads = None
    for method in METHODS:
        llm = LLM(speculative_config=_spec(method, args.k), max_model_len=8192)
        if workloads is None:  # the chat's turns come from the reference engine's answers
            vocab = llm.engine.model_config.vocab_size
            make = {"rewrite": lambda: (_rewrite(), True), "document": lambda: (_document(), True),
                    "chat": lambda: (_chat(llm, params), True),
                    "random": lambda: (_random(vocab), False)}
            workloads = {name: make[name]() for name in args.workloads.split(",")}
        for name, (prompts, chat) in workloads.items():
            before = llm.engine.stats().spec_decode
            decoded = 0
            for _ in range(args.repeats):
                rate, ids = _one(llm, prompts, params, chat)
                results.setdefault(name, {}).setdefault(method, []).append(rate)
                tokens.setdefault(name, {})[method] = ids
                decoded += sum(len(t) - 1 for t in ids)  # the first token is the prefill's
            counts[name, method] = (decoded, *_counts(before, llm.engine.stats().spec_decode))
            print(f"{method:7s} {name:9s} {statistics.median(results[name][method]):7.1f} "
                  f"tok/s  {_acceptance(*counts[name, method][1:])}", flush=True)
        llm.engine.shutdown()
    print(f"\ndecode tokens/s, SmolLM2-135M, batch 1, greedy, k={args.k}, "
          f"max_tokens={args.max_tokens}, median of {args.repeats}")
    print(f"{'workload':10s}" + "".join(f"{m:>18s}" for m in METHODS))
    for name, by_method in results.items():
        off = statistics.median(by_method["off"])
        cells = []
        for m in METHODS:
            med = statistics.median(by_method[m])
            same = "" if m == "off" else (" =" if tokens[name][m] == tokens[name]["off"] else
                                          " !=")
            cells.append(f"{med:8.1f} ({med / off:4.2f}x){same}")
        print(f"{name:10s}" + "".join(f"{c:>18s}" for c in cells))
    print("(=: greedy tokens equal to off's, !=: they differ)")
    for (name, method), (decoded, drafts, _, accepted) in counts.items():
        speedup = statistics.median(results[name][method]) / statistics.median(
            results[name]["off"])
        if drafts:
            print(f"{name:10s}{method:8s}"
                  f"{_ceiling(decoded, drafts, accepted, speedup)}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "k": args.k,
                                         "max_tokens": args.max_tokens,
                                         "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
