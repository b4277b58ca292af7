"""`kvserve bench prefix`: TTFT of a prompt whose prefix is cached against the same prompt
cold, through the offline `LLM`.

For each prefix length in --prefix-lens, a prompt = that many random tokens + a unique
--suffix-len suffix, generating 1 token; cold: the prefix cache reset just before
(--cold-method reset) or an engine with prefix caching off (--cold-method off); cached: the
prefix warmed just before by another request with the same prefix and a different suffix. TTFT
is the engine's own (first token time - arrival time). --num-samples (cold, cached) pairs per
length, alternating which goes first; reported: medians [min-max], the reduction and speed-up
of the medians, the cached tokens, and whether both gave the same greedy token (a check of the
cached KV).
"""

from __future__ import annotations

import argparse
import sys

from kvserve.bench import offline, results
from kvserve.bench.noise import Interference
from kvserve.bench.stats import spread

MODES = ("cold", "cached")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-lens", default="512,1024,2048",
                   help="comma list of prefix lengths in tokens (default 512,1024,2048)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=3, help="(cold, cached) pairs per length")
    p.add_argument("--cold-method", choices=["reset", "off"], default="reset",
                   help="cold: reset the prefix cache first (default), or an engine with "
                   "prefix caching off")
    offline.add_common_args(p)
    results.add_result_args(p, "bars of cold and cached TTFT per prefix length")


def measure(engines: dict, prefix: list[int], measured: list[int], warming: list[int],
            samples: int) -> dict[str, list[dict]]:
    """`samples` (cold, cached) pairs of TTFT samples for prefix + measured -> 1 token."""
    from kvserve import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def gen(llm, ids):
        return llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0]

    out: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(samples):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            llm = engines[mode]
            llm.reset_prefix_cache()
            with Interference() as noise:
                if mode == "cached":
                    gen(llm, prefix + warming)
                res = gen(llm, prefix + measured)
            out[mode].append({"ttft_s": res.metrics.ttft, "cached_tokens": res.num_cached_tokens,
                              "first_token": res.outputs[0].token_ids[0],
                              "foreign_cores": noise.result.get("foreign_cores", 0.0)})
    return out


def table_row(length: int, suffix_len: int, samples: dict[str, list[dict]]) -> dict:
    row: dict = {"prefix_len": length, "suffix_len": suffix_len, "samples": samples}
    for mode in MODES:
        row[mode] = spread([s["ttft_s"] for s in samples[mode]])
        row[f"{mode}_cached_tokens"] = sorted({s["cached_tokens"] for s in samples[mode]})
    row["reduction"] = 1.0 - row["cached"]["median"] / row["cold"]["median"]
    row["speedup"] = row["cold"]["median"] / row["cached"]["median"]
    row["same_first_token"] = ({s["first_token"] for s in samples["cold"]}
                               == {s["first_token"] for s in samples["cached"]})
    return row


def _ms(s: dict) -> str:
    return f"{1e3 * s['median']:.1f} [{1e3 * s['min']:.1f}-{1e3 * s['max']:.1f}]"


def run(args: argparse.Namespace) -> dict:
    lens = sorted({int(x) for x in args.prefix_lens.split(",") if x.strip()})
    need = max(lens) + args.suffix_len + 1
    size = {"max_model_len": need if args.max_model_len is None else None}
    cached_llm, load_s = offline.load_llm(args, enable_prefix_caching=True, **size)
    cold_llm = cached_llm
    if args.cold_method == "off":
        cold_llm, _ = offline.load_llm(args, enable_prefix_caching=False, **size)
    engines = {"cold": cold_llm, "cached": cached_llm}
    seed = args.seed or 0
    measured, warming, *junk = offline.token_prompts(cached_llm, 4, args.suffix_len, seed + 1)
    for llm in {id(e): e for e in engines.values()}.values():  # warm both attention paths
        measure({"cold": llm, "cached": llm}, junk[0], junk[1], warming, 1)
    rows = []
    it = lens
    if not args.disable_tqdm:
        from tqdm import tqdm

        it = tqdm(lens, desc="prefix lengths", file=sys.stderr, dynamic_ncols=True)
    for length in it:
        prefix = offline.token_prompts(cached_llm, 1, length, seed * 1_000_003 + length)[0]
        rows.append(table_row(length, args.suffix_len,
                              measure(engines, prefix, measured, warming, args.num_samples)))
    cold_desc = ("prefix cache reset first" if args.cold_method == "reset"
                 else "prefix caching off")
    print(f"TTFT of a prefix + {args.suffix_len}-token suffix -> 1 token, ms, median [min-max] "
          f"of {args.num_samples}; cold = {cold_desc}")
    print(f"{'prefix':>7} {'cold':>24} {'cached':>24} {'reduction':>10} {'speedup':>8} "
          f"{'cached tok':>10} {'same token':>10}")
    for r in rows:
        print(f"{r['prefix_len']:>7,} {_ms(r['cold']):>24} {_ms(r['cached']):>24} "
              f"{100 * r['reduction']:>9.1f}% {r['speedup']:>7.1f}x "
              f"{','.join(map(str, r['cached_cached_tokens'])):>10} "
              f"{'yes' if r['same_first_token'] else 'NO':>10}")
    model = str(cached_llm.engine.config.model)
    out = {"model": model, "cold_method": args.cold_method, "load_s": load_s, "rows": rows}
    title = (f"kvserve prefix caching: TTFT, cold vs cached prefix (median of "
             f"{args.num_samples}, whiskers min-max)\n{model}")
    results.finish(args, out, "prefix", lambda o, path: results.plot_prefix(o["rows"], path,
                                                                             title))
    return out
