"""`kvserve demo` (what `make demo` runs): one screen that shows what kvserve is for.

Round 1 completes a few code prompts with the embedded `stdlib-coder` model, greedy and sampled,
in one continuous batch. Round 2 is the case prefix caching exists for: several requests that
share a long prefix (a standard-library module's source as context, then a different question
each), sent one after another. The first computes the prefix cold; the others find it in the
paged KV cache, and the demo prints how many prompt tokens each one got from the cache, TTFT cold
vs cached, and how much of the KV pool the cached prefix occupies.
"""

from __future__ import annotations

import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.llm import LLM
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams

# Each prompt stops mid-line, where the next tokens are code rather than indentation.
CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n <",
    "import os\n\n\ndef list_python_files(root):\n    for dirpath, dirnames, filenames in os.",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n        self.",
]

# Round 2's shared context: a short, stable standard-library module.
CONTEXT_MODULE = "bisect.py"
# The "questions": the searching recipes of the bisect documentation, each asked of the module.
QUESTIONS = [
    "\n\ndef index(a, x):\n    'Locate the leftmost value exactly equal to x'\n    i = bisect_",
    "\n\ndef find_lt(a, x):\n    'Find rightmost value less than x'\n    i = bisect_",
    "\n\ndef find_gt(a, x):\n    'Find leftmost value greater than x'\n    i = bisect_",
    "\n\ndef find_ge(a, x):\n    'Find leftmost item greater than or equal to x'\n    i = bisect_",
]


@dataclass
class DemoOptions:
    max_tokens: int = 40
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    show_lines: int = 4  # lines of each completion shown


def _shown(text: str, lines: int) -> str:
    """The first `lines` lines of a completion, indented, so that a screen holds the demo."""
    parts = text.split("\n")
    more = len(parts) > lines
    body = "\n".join("      | " + p for p in parts[:lines])
    return body + ("\n      | ..." if more else "")


def _ms(seconds: float | None) -> float:
    return (seconds or 0.0) * 1000.0


def round_one(llm: LLM, opts: DemoOptions) -> None:
    """Greedy and sampled completions of every code prompt, all in one batch."""
    greedy = SamplingParams(temperature=0.0, max_tokens=opts.max_tokens)
    sampled = SamplingParams(temperature=opts.temperature, top_p=opts.top_p,
                             max_tokens=opts.max_tokens, seed=opts.seed)
    prompts = CODE_PROMPTS + CODE_PROMPTS
    params = [greedy] * len(CODE_PROMPTS) + [sampled] * len(CODE_PROMPTS)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = len(CODE_PROMPTS)
    print(f"== Round 1: {n} code prompts, greedy and sampled (T={opts.temperature}, "
          f"top_p={opts.top_p}), {len(prompts)} requests in one batch")
    for i, prompt in enumerate(CODE_PROMPTS):
        lines = prompt.split("\n")
        print(f"\n  [{i + 1}] {lines[0]}" + (f"  ... {lines[-1]}" if len(lines) > 1 else ""))
        print("    greedy:\n" + _shown(outs[i].outputs[0].text, opts.show_lines))
        print("    sampled:\n" + _shown(outs[n + i].outputs[0].text, opts.show_lines))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n  {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s across the batch)")


def context_source() -> str:
    """The context module's source, from the running Python's standard library."""
    return (Path(sysconfig.get_paths()["stdlib"]) / CONTEXT_MODULE).read_text(encoding="utf-8")


def _first_line(out: RequestOutput) -> str:
    """What the model wrote after `i = bisect_`, up to the end of that line."""
    return ("bisect_" + out.outputs[0].text.split("\n")[0])[:44]


def round_two(llm: LLM, opts: DemoOptions) -> None:
    """A shared long prefix: one cold request, then the rest served from the prefix cache."""
    context = context_source()
    llm.reset_prefix_cache()
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [context + q for q in QUESTIONS]
    # One at a time, so that each TTFT is one request's prefill: cold, then from the cache.
    outs = [llm.generate(p, greedy, use_tqdm=False)[0] for p in prompts]
    ctx_tokens = len(llm.get_tokenizer().encode(context, add_special_tokens=False))
    print(f"\n== Round 2: {len(QUESTIONS)} requests sharing a prefix: the source of "
          f"{CONTEXT_MODULE} ({ctx_tokens} tokens) + a different function each")
    print(f"  {'request':<13}{'prompt':>7}{'cached':>8}{'TTFT ms':>9}  completion")
    for i, (q, out) in enumerate(zip(QUESTIONS, outs)):
        name = q.strip().split("(")[0].removeprefix("def ")
        label = f"{name} ({'cold' if i == 0 else 'warm'})"
        print(f"  {label:<13}{len(out.prompt_token_ids):>7}{out.num_cached_tokens:>8}"
              f"{_ms(out.metrics.ttft):>9.1f}  {_first_line(out)}")
    cold_ms = _ms(outs[0].metrics.ttft)
    # The median: on a shared machine one request in a few can stall behind another job.
    warm_ms = statistics.median(_ms(o.metrics.ttft) for o in outs[1:])
    print(f"  TTFT cold {cold_ms:.1f} ms vs cached {warm_ms:.1f} ms (median of "
          f"{len(outs) - 1}): {cold_ms / max(warm_ms, 1e-6):.1f}x faster")
    kv = llm.engine.kv
    stats = llm.engine.stats()
    prefix_blocks = outs[1].num_cached_tokens // kv.block_size
    print(f"  KV pool: {kv.num_blocks:,} blocks of {kv.block_size} tokens; the shared prefix is "
          f"{prefix_blocks} blocks, stored once for {len(outs)} requests; now "
          f"{kv.pool.num_cached_idle} blocks hold idle cached prefixes, usage "
          f"{stats.kv_cache_usage:.1%} (idle cached blocks count as free)")
    print(f"  prefix cache: {stats.prefix_cache_hits:,} of {stats.prefix_cache_queries:,} prompt "
          f"tokens hit ({stats.prefix_cache_hits / max(1, stats.prefix_cache_queries):.0%})")


def run_demo(llm: LLM, opts: DemoOptions | None = None) -> None:
    opts = opts or DemoOptions()
    t0 = time.perf_counter()
    round_one(llm, opts)
    round_two(llm, opts)
    print(f"\ndemo rounds took {time.perf_counter() - t0:.1f} s on model {llm.engine.config.model}")
