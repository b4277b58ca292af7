#!/usr/bin/env python
"""Document reuse anywhere in the prompt (CacheBlend, kvserve/blend/) on a RAG workload: TTFT
against prefix-only caching and no caching, and the quality of blended answers against full
recompute, on the embedded default model (SmolLM2-135M) or any model path.

The workload (issue 50's): a pool of 40 passages of 150-300 tokens cut from documentation
found on every machine of this kind (the docstrings of Python's standard library); each
question draws 4-6 passages in random order behind a ~200-token system prompt and asks what
follows a phrase taken from one of them. Every mode gets the same token ids (each passage
tokenized on its own, kvserve/blend/parts.py); only "blend" marks the passages as documents.

Modes, each its own engine, each warmed by the same requests (every passage once, behind the
system prompt; off the clock):
  none     enable_prefix_caching=False: every prompt computed whole;
  prefix   the prefix cache (the system prompt hits; passages in a new order miss);
  blend    blend_config {"recompute_fraction": F, "selection": S}: stored passages placed,
           F of each recomputed (chosen by --selection), the question computed.

TTFT: first-token time minus arrival, max_tokens 1, at batch 1 (one request at a time) and
with --users closed-loop users (each sends its next question when its last one is answered).

Quality (--quality): greedy answers of --answer-tokens tokens with prefix caching (exact: full
recompute) and blended at each --fractions value: the share identical token for token, and the
log-likelihood per token of the exact answer under blending (teacher-forced where the blended
answer leaves it: each remaining token forced by logit_bias, its raw logprob read) against its
log-likelihood under full recompute.

    .venv/bin/python benchmarks/bench_doc_blend.py                       # TTFT, ~10 min
    .venv/bin/python benchmarks/bench_doc_blend.py --quality --questions 40
    .venv/bin/python benchmarks/bench_doc_blend.py --quick               # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.record import Row, add_record_arg, current_machine, ratio, write_record
from kvserve.bench.stats import percentile

MODULES = ("json", "re", "os", "collections", "itertools", "functools", "pathlib", "argparse",
           "logging", "subprocess", "threading", "asyncio", "typing", "dataclasses", "unittest",
           "email", "http.client", "urllib.request", "sqlite3", "csv", "datetime", "decimal",
           "fractions", "heapq", "bisect", "random", "statistics", "string", "textwrap",
           "shutil", "tempfile", "zipfile", "tarfile", "pickle", "copy", "inspect",
           "contextlib", "enum", "socket", "selectors", "queue", "sched", "struct", "codecs",
           "io", "gzip", "hashlib", "secrets", "uuid", "configparser", "timeit", "doctest",
           "ast", "tokenize", "difflib", "pprint", "shlex", "glob", "fnmatch", "locale")
SYSTEM = (
    "You are a careful assistant that answers questions about the Python standard library. "
    "Below are passages taken from its documentation. They were retrieved by a search engine "
    "for the user's question, so some of them are relevant and some are not, and they come in "
    "no particular order. Read every passage before you answer. Answer only from what the "
    "passages say: do not use what you remember about Python, and do not guess. When the "
    "question asks what follows a phrase, find the passage that contains the phrase and "
    "continue it with the words that come right after it in that passage, exactly as they are "
    "written there, without rephrasing, without quotation marks and without comments. If no "
    "passage contains the phrase, say that the passages do not contain it. Keep the answer "
    "short: one sentence is enough. Do not repeat the question, do not explain how you found "
    "the answer, and do not mention the passages or the search engine in your answer. The "
    "user reads your answer on a small screen, so plain text is best: no lists, no headings, "
    "no code blocks unless the passage itself is code.\n\nPassages:\n\n")


@dataclass
class Question:
    ids: list[int]
    documents: list[list[int]]


def passages(tokenizer, count: int = 40, low: int = 150, high: int = 300) -> list[str]:
    """`count` passages of low..high tokens: paragraphs of standard-library docstrings joined
    in order until long enough, at most two per module (so the pool covers many topics)."""
    out: list[str] = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        paragraphs = [p.strip() for p in doc.split("\n\n") if len(p.split()) > 3]
        taken, current = 0, []
        for paragraph in paragraphs:
            current.append(paragraph)
            text = "\n\n".join(current)
            n = len(tokenizer.encode(text, add_special_tokens=False))
            if n > high:
                current = [paragraph] if len(tokenizer.encode(
                    paragraph, add_special_tokens=False)) <= high else []
                continue
            if n >= low:
                out.append(text)
                taken, current = taken + 1, []
                if taken == 2:
                    break
        if len(out) >= count:
            return out[:count]
    raise SystemExit(f"only {len(out)} passages of {low}-{high} tokens found")


def questions(tokenizer, pool: list[str], n: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    system = tokenizer.encode(SYSTEM, add_special_tokens=True)
    encoded = [tokenizer.encode(p + "\n\n", add_special_tokens=False) for p in pool]
    out = []
    for _ in range(n):
        chosen = rng.sample(range(len(pool)), rng.randint(4, 6))
        target = pool[rng.choice(chosen)].split()
        at = rng.randrange(0, max(1, len(target) - 12))
        phrase = " ".join(target[at:at + 6])
        ids, documents = list(system), []
        for i in chosen:
            documents.append([len(ids), len(ids) + len(encoded[i])])
            ids.extend(encoded[i])
        ids.extend(tokenizer.encode(f'Question: what follows "{phrase}"?\nAnswer:',
                                    add_special_tokens=False))
        out.append(Question(ids, documents))
    return out


def warm_up(llm: LLM, tokenizer, pool: list[str]) -> None:
    """Every passage once behind the system prompt (blend: as a document), off the clock."""
    system = tokenizer.encode(SYSTEM, add_special_tokens=True)
    prompts = []
    for p in pool:
        doc = tokenizer.encode(p + "\n\n", add_special_tokens=False)
        tail = tokenizer.encode("Question: what is this passage about?\nAnswer:",
                                add_special_tokens=False)
        prompts.append({"prompt_token_ids": system + doc + tail,
                        "documents": [[len(system), len(system) + len(doc)]]})
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)


def prompt_of(q: Question, blend: bool) -> dict:
    return {"prompt_token_ids": q.ids, **({"documents": q.documents} if blend else {})}


def ttfts(llm: LLM, qs: list[Question], blend: bool, users: int) -> list[float]:
    """Closed-loop users: each sends its next question when its last one is answered."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0)
    queues = [list(qs[u::users]) for u in range(users)]
    owner: dict[str, int] = {}
    out: list[float] = []
    counter = 0

    def submit(u: int) -> None:
        nonlocal counter
        if queues[u]:
            rid = f"q{counter}"
            counter += 1
            engine.add_request(prompt_of(queues[u].pop(0), blend), params, request_id=rid)
            owner[rid] = u

    for u in range(users):
        submit(u)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out.append(o.metrics.first_token_time - o.metrics.arrival_time)
                submit(owner.pop(o.request_id))
    return out


def answers(llm: LLM, qs: list[Question], blend: bool, n: int) -> list[tuple[list[int],
                                                                            list[float]]]:
    params = SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True)
    outs = llm.generate([prompt_of(q, blend) for q in qs], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for t, lp in zip(o.outputs[0].token_ids,
                                                              o.outputs[0].logprobs)])
            for o in outs]


def forced_logprobs(llm: LLM, q: Question, answer: list[int], start: int) -> list[float]:
    """Raw logprobs of answer[start:] under blending, each token forced (logit_bias) after
    the exact answer's tokens before it."""
    out = []
    for k in range(start, len(answer)):
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                logit_bias={answer[k]: 100.0})
        prompt = {"prompt_token_ids": q.ids + answer[:k], "documents": q.documents}
        o = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert o.token_ids[0] == answer[k]
        out.append(o.logprobs[0][answer[k]])
    return out


def build(model: str | None, mode: str, fraction: float, selection: str = "deviation") -> LLM:
    kwargs: dict = {} if model is None else {"model": model}
    if mode == "none":
        kwargs["enable_prefix_caching"] = False
    if mode == "blend":
        kwargs["blend_config"] = {"recompute_fraction": fraction, "selection": selection}
    return LLM(**kwargs)


def run_ttft(args, tokenizer, pool, qs) -> dict:
    """Each pass its own questions (the same passages in other draws and orders): a pass must
    not hit the whole prompts an earlier pass left in the prefix cache."""
    results = {}
    later = questions(tokenizer, pool, len(qs), args.seed + 1)
    for mode in ("none", "prefix", "blend"):
        llm = build(args.model, mode, args.fraction, args.selection)
        warm_up(llm, tokenizer, pool)
        row = {}
        for users, batch in ((1, qs), (args.users, later)):
            times = ttfts(llm, batch, mode == "blend", users)
            row[users] = statistics.median(times)
            print(f"  {mode:6s} users {users}: TTFT p50 {row[users] * 1e3:8.1f} ms "
                  f"(p90 {percentile(times, 90) * 1e3:.1f})", flush=True)
        if mode == "blend":
            row["counters"] = llm.engine.scheduler.blend.counters.as_dict()
        results[mode] = row
        del llm
        gc.collect()
    for users in (1, args.users):
        b = results["blend"][users]
        print(f"users {users}: blend {b * 1e3:.1f} ms; prefix-only / blend "
              f"{results['prefix'][users] / b:.2f}x; none / blend "
              f"{results['none'][users] / b:.2f}x")
    return results


def run_quality(args, tokenizer, pool, qs) -> dict:
    exact_llm = build(args.model, "prefix", 0.0)
    exact = answers(exact_llm, qs, False, args.answer_tokens)
    del exact_llm
    gc.collect()
    exact_nll = statistics.mean(-statistics.mean(lps) for _, lps in exact)
    results = {"exact_nll_per_token": exact_nll}
    for fraction in args.fractions:
        llm = build(args.model, "blend", fraction, args.selection)
        warm_up(llm, tokenizer, pool)
        blended = answers(llm, qs, True, args.answer_tokens)
        same, nlls = 0, []
        for q, (ref, _), (got, lps) in zip(qs, exact, blended):
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            same += first == len(ref)
            forced = lps[:first] + (forced_logprobs(llm, q, ref, first)
                                    if first < len(ref) else [])
            nlls.append(-statistics.mean(forced))
        nll = statistics.mean(nlls)
        results[fraction] = {"identical": same / len(qs), "nll_per_token": nll,
                             "nll_change": nll / exact_nll - 1,
                             "counters": llm.engine.scheduler.blend.counters.as_dict()}
        print(f"  fraction {fraction:4.2f}: identical {same}/{len(qs)} "
              f"({100 * same / len(qs):.0f}%), NLL/token {nll:.4f} vs exact {exact_nll:.4f} "
              f"({100 * (nll / exact_nll - 1):+.2f}%)", flush=True)
        del llm
        gc.collect()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: the embedded one)")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.15, help="TTFT runs' fraction")
    ap.add_argument("--quality", action="store_true", help="measure answer quality instead")
    ap.add_argument("--selection", choices=("deviation", "first"), default="deviation",
                    help="blend_config selection (the paper's, or the first tokens)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.0])
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    add_record_arg(ap, "doc-reuse")
    args = ap.parse_args()
    if args.quick:
        args.questions, args.users, args.answer_tokens = 4, 2, 4
    print(current_machine(), flush=True)
    probe = build(args.model, "prefix", 0.0)
    tokenizer = probe.get_tokenizer()
    del probe
    gc.collect()
    pool = passages(tokenizer)
    qs = questions(tokenizer, pool, args.questions, args.seed)
    sizes = [len(q.ids) for q in qs]
    print(f"{len(pool)} passages, {len(qs)} questions of {min(sizes)}-{max(sizes)} tokens "
          f"(median {statistics.median(sizes)})", flush=True)
    started = time.perf_counter()
    results = run_quality(args, tokenizer, pool, qs) if args.quality \
        else run_ttft(args, tokenizer, pool, qs)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.record:
        record(args, results, sizes)


def record(args, results: dict, sizes: list[int]) -> None:
    """The figures page's record: blended TTFT over prefix-only and no caching, or (--quality)
    the answers identical to full recompute (issue 50's >= 90%) and the exact answers'
    NLL change (within 2%) per fraction."""
    model = f"-{Path(args.model).name}" if args.model else ""
    prompts = f"prompts of {min(sizes):,}-{max(sizes):,} tokens"
    rows = []
    if args.quality:
        for fraction in args.fractions:
            r = results[fraction]
            rows += [Row(f"recompute_fraction {fraction:g}: identical answers", "%",
                         round(100 * r["identical"], 1), None, None, ">= 90%",
                         r["identical"] >= 0.9),
                     Row(f"recompute_fraction {fraction:g}: NLL/token change", "%",
                         f"{100 * r['nll_change']:+.2f}%", None, None, "within 2%",
                         abs(r["nll_change"]) <= 0.02)]
        write_record(args.record, name=f"bench-doc-blend-quality-{args.selection}{model}",
                     rows=rows, title=f"Answers identical to full recompute, {args.questions} "
                     f"questions, selection {args.selection}",
                     peer="none: kvserve recomputing everything (the prefix-caching engine, "
                     "exact)", notes=f"Greedy {args.answer_tokens}-token answers; {prompts}.")
        return
    for users in (1, args.users):
        blend = 1e3 * results["blend"][users]
        for mode, label in (("prefix", "prefix-only"), ("none", "no caching")):
            other = 1e3 * results[mode][users]
            rows.append(Row(f"{users} user{'s' if users > 1 else ''}: blend / {label}", "ms",
                            round(blend, 1), round(other, 1), ratio(blend, other),
                            "<= 0.4x (2.5x lower)", blend <= 0.4 * other))
    write_record(args.record, name=f"bench-doc-blend{model}", rows=rows,
                 title="TTFT p50 with passages reused anywhere in the prompt",
                 peer="none: kvserve with prefix caching only (and with no caching) on the "
                 "same token ids", notes=f"recompute_fraction {args.fraction:g}, selection "
                 f"{args.selection}; {args.questions} questions, {prompts}.")


if __name__ == "__main__":
    main()
