"""Does a request get the same tokens and logprobs whatever the cache, the chunks and the batch
did? (issue 64, acceptance 1)

The issue's sequence first, as a user ran it on the default model: a code-copy chat, a chat on
the first 3,000 characters of Python's LICENSE.txt, then that chat again (served from the prefix
cache). Then held-out variations: another prompt (a slice of LICENSE.txt or of this repository's
docs at a seeded offset), a prefill chunk size in 16-512 and 1-8 neighbours. Each variation
runs the request three ways and compares them bit for bit (greedy tokens, and each chosen
token's logprob as a float, ==):

  alone      a fresh engine, prefix caching off, the request by itself, unchunked
  in batch   an engine with prefix caching and the variation's chunk size, the request among
             its neighbours (one generate call)
  cached     the same engine, the request again by itself: its prompt now comes from the cache

    .venv/bin/python benchmarks/check_invariance.py --deterministic
    .venv/bin/python benchmarks/check_invariance.py --deterministic --model 1b.Q4_K_M.gguf
    KVSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/check_invariance.py --deterministic

Exits 1 when any comparison differs (prints the first differing position).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
LICENSE = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
    / "LICENSE.txt"
CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
'''


def texts() -> list[str]:
    """The held-out prompts' sources: LICENSE.txt (where this Python has one) and the docs."""
    found = [LICENSE.read_text(errors="replace")] if LICENSE.exists() else []
    found += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))[:12]]
    return [t for t in found if len(t) > 4000]


@dataclass
class Variation:
    prompt: str
    chunk: int  # long_prefill_token_threshold (and the step budget)
    neighbours: list[str]


def variations(n: int, seed: int) -> list[Variation]:
    rng = random.Random(seed)
    sources = texts()
    out = []
    for _ in range(n):
        def passage(chars: int) -> str:
            t = rng.choice(sources)
            at = rng.randrange(0, len(t) - chars)
            return t[at:at + chars]

        prompt = f"Summarize this text:\n\n{passage(rng.randrange(400, 3000))}"
        neighbours = [f"Explain this:\n\n{passage(rng.randrange(100, 1500))}"
                      for _ in range(rng.randint(1, 8))]
        out.append(Variation(prompt, rng.choice([16, 32, 48, 64, 100, 128, 256, 384, 512]),
                             neighbours))
    return out


def chat(llm: LLM, prompts: list[str], sp: SamplingParams) -> list[tuple[list[int], list[float]]]:
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(msgs, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def differs(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> str | None:
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if x != y:
            return f"token {i}: {x} != {y}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        if x != y:
            return f"logprob {i}: {x!r} != {y!r} ({x - y:+.3g})"
    return None if len(a[0]) == len(b[0]) else f"lengths {len(a[0])} != {len(b[0])}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 Q4_1")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--variations", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=64)
    ap.add_argument("--skip-sequence", action="store_true", help="the variations only")
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    base = dict(model=args.model, deterministic=args.deterministic, max_model_len=4096, seed=0)
    failures = 0

    def report(name: str, a, b) -> None:
        nonlocal failures
        why = differs(a, b)
        failures += why is not None
        print(f"  {name:<24} {'same' if why is None else 'DIFFERS: ' + why}", flush=True)

    if not args.skip_sequence and LICENSE.exists():
        print("the issue's sequence: code chat, LICENSE chat, LICENSE chat again (cached)")
        llm = LLM(enable_prefix_caching=True, **base)
        license_chat = f"What is this text about?\n\n{LICENSE.read_text()[:3000]}"
        chat(llm, [f"Copy this code exactly:\n\n{CODE}"], sp)
        first = chat(llm, [license_chat], sp)[0]
        again = chat(llm, [license_chat], sp)[0]
        report("first vs cached", first, again)
        llm.engine.shutdown()
    for i, v in enumerate(variations(args.variations, args.seed)):
        started = time.perf_counter()
        print(f"variation {i}: {len(v.prompt)} chars, chunk {v.chunk}, "
              f"{len(v.neighbours)} neighbours", flush=True)
        alone = LLM(enable_prefix_caching=False, **base)
        want = chat(alone, [v.prompt], sp)[0]
        alone.engine.shutdown()
        llm = LLM(enable_prefix_caching=True, long_prefill_token_threshold=v.chunk,
                  max_num_batched_tokens=max(v.chunk, 64) * 4, **base)
        in_batch = chat(llm, [v.prompt] + v.neighbours, sp)[0]
        cached = chat(llm, [v.prompt], sp)[0]
        llm.engine.shutdown()
        report("alone vs in batch", want, in_batch)
        report("alone vs cached", want, cached)
        print(f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{failures} comparisons differ" if failures else "every comparison the same")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
