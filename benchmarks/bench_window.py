#!/usr/bin/env python
"""What honouring a sliding window costs or saves on the CPU (issue 15, part 1): the same
random-weight Mistral-style weights served twice in one process, once with `sliding_window: W`
on every layer and once with `sliding_window: null` (full attention, what kvserve computed for
every Mistral before), side by side.

Measured per configuration, interleaved, medians over --repeats:
  * prefill: one --context-token prompt, wall time of its prefill (TTFT, chunked by
    max_num_batched_tokens);
  * decode: --batch requests at about --context tokens each, the median engine step once all
    are decoding.

A windowed layer gathers only the blocks its window can see, so decode attention reads about W
tokens per layer instead of the whole context; the masks it builds per step are the overhead.

    .venv/bin/python benchmarks/bench_window.py [--context 4096] [--window 512] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model_loader.make_model import make_model  # noqa: E402


def cpu_line() -> str:
    """The CPU as kvserve sees it (its flags capped by $KVSERVE_CPU_ISA where set)."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().summary()


def checkpoints(root: Path, window: int) -> dict[str, Path]:
    """The same weights with a window on every layer and without one."""
    full = make_model(root / "full", "mistral", "small", seed=0)
    windowed = root / "windowed"
    windowed.mkdir()
    for f in full.iterdir():
        if f.name != "config.json":
            (windowed / f.name).symlink_to(f)
    config = json.loads((full / "config.json").read_text())
    config["sliding_window"] = window
    (windowed / "config.json").write_text(json.dumps(config, indent=2))
    return {"full": full, "windowed": windowed}


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - t


def decode_step_seconds(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    times = []
    while engine.has_unfinished_requests():
        decoding = not engine.scheduler.waiting and all(
            r.num_uncomputed_tokens == 1 for r in engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="decode steps per repeat (16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    print(cpu_line())
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(args.context)]
    batch = [[rng.randrange(3, 32000) for _ in range(args.context - args.steps - 1)]
             for _ in range(args.batch)]
    root = Path(tempfile.mkdtemp(prefix="bench-window-"))
    try:
        paths = checkpoints(root, args.window)
        llms = {name: LLM(model=str(path), dtype="float32", block_size=16,
                          max_model_len=args.context + 16, max_num_batched_tokens=2048,
                          enable_prefix_caching=False, num_threads=args.threads,
                          kv_cache_memory_bytes=(args.batch + 1) * (args.context + 32) * 32768)
                for name, path in paths.items()}
        results: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []}
                                                      for n in llms}
        for r in range(args.repeats):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for name in order:
                results[name]["prefill"].append(prefill_seconds(llms[name], prompt))
                results[name]["decode"].append(
                    decode_step_seconds(llms[name], batch, args.steps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    print(f"mistral small (8 layers, hidden 512, GQA 8/2), float32, context {args.context:,}, "
          f"window {args.window:,}, {args.repeats} repeats, medians")
    print(f"{'':10} {'prefill s':>10} {'decode step ms (batch ' + str(args.batch) + ')':>26}")
    for n in ("full", "windowed"):
        print(f"{n:10} {med[n]['prefill']:>10.3f} {1e3 * med[n]['decode']:>26.1f}")
    print(f"{'full/win':10} {med['full']['prefill'] / med['windowed']['prefill']:>9.2f}x "
          f"{med['full']['decode'] / med['windowed']['decode']:>25.2f}x")


if __name__ == "__main__":
    main()
