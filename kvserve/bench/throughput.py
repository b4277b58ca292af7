"""`kvserve bench throughput`: offline throughput of the `LLM`, as `vllm bench throughput`
measures it: --num-prompts prompts of --input-len random tokens (a common --prefix-len prefix
first, if any), each generating exactly --output-len tokens, all given to one `generate`;
reported: requests/s, total and output tokens/s, the prefill time (until every request had its
first token), the decode rate after it and the median TTFT; with --ceiling, the
share of this machine's matmul ceiling (and at one prompt, of its read bandwidth) it reached;
with --structured-regex, a share of the requests constrained by a grammar (what structured
outputs cost a batch, against the same run without the flag)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from kvserve.bench import ceilings, offline, results


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=0,
                   help="a common prefix of this many tokens before each prompt (default 0)")
    p.add_argument("--structured-regex", metavar="REGEX", default=None,
                   help="constrain requests to this regex (structured outputs); one that "
                        "cannot end sooner keeps them to --output-len, e.g. '[a-z ]{400}'")
    p.add_argument("--structured-fraction", type=float, default=1.0, metavar="F",
                   help="the share of the requests --structured-regex constrains (1.0)")
    offline.add_common_args(p)
    ceilings.add_ceiling_arg(p)
    results.add_result_args(p, "finished requests over time")


def constrained(llm, params, n: int, regex: str, fraction: float) -> list:
    """`params` for n requests, the first round(n * fraction) constrained to `regex`. The
    grammar is compiled here, before the timing: a compile is cached per grammar, so what
    the run measures is its per-step work (bitmask fills, masked rows)."""
    from kvserve.structured import StructuredOutputsParams

    grammar = StructuredOutputsParams(regex=regex)
    llm.engine.grammars.compile(grammar)
    k = round(n * fraction)
    return [dataclasses.replace(params, structured_outputs=grammar) if i < k else params
            for i in range(n)]


def measure(llm, prompts: list[list[int]], output_len: int, use_tqdm: bool = False,
            structured: tuple[str, float] | None = None, **sampling) -> dict:
    """One timed generate of `prompts`, every request generating `output_len` tokens (with
    `sampling`'s extra SamplingParams fields, e.g. a cache report whose cost is measured;
    `structured`: (regex, fraction), see `constrained`)."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, **sampling)
    if structured:
        params = constrained(llm, params, len(prompts), *structured)
    # warm-up: first-call costs (allocations, kernel choices) stay out of the figure
    llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    outs, wall, noise, start = offline.timed_generate(llm, prompts, params, use_tqdm)
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    n_in = sum(len(p) for p in prompts)
    out = {"num_requests": len(prompts), "elapsed_time": wall,
           "requests_per_second": len(prompts) / wall, "tokens_per_second": (n_in + n_out) / wall,
           "output_throughput": n_out / wall, "total_num_tokens": n_in + n_out,
           "total_output_tokens": n_out, "full_length": n_out == len(prompts) * output_len,
           "cached_tokens": sum(o.num_cached_tokens for o in outs), **noise,
           "first_outputs": [list(t) for t in tokens[:4]]}
    firsts = [o.metrics.first_token_time for o in outs]
    lasts = [o.metrics.last_token_time for o in outs]
    if all(t is not None for t in firsts + lasts):
        out["prefill_s"] = max(firsts) - start
        out["ttft_median_s"] = statistics.median(f - start for f in firsts)
        decode_s = max(lasts) - max(firsts)
        if len(outs) == 1 and lasts[0] > firsts[0]:
            decode_s = lasts[0] - firsts[0]
        if decode_s > 0:
            out["decode_tok_s"] = sum(len(t) - 1 for t in tokens) / decode_s
        out["finish_times"] = [t - start for t in lasts]
    return out


def run(args: argparse.Namespace) -> dict:
    llm, load_s = offline.load_llm(args)
    seed = args.seed or 0
    prefix = offline.token_prompts(llm, 1, args.prefix_len, seed + 1)[0]
    prompts = [prefix + p for p in offline.token_prompts(llm, args.num_prompts,
                                                         args.input_len, seed)]
    out = {"model": str(llm.engine.config.model), "input_len": args.prefix_len + args.input_len,
           "output_len": args.output_len, "load_s": load_s,
           **measure(llm, prompts, args.output_len, use_tqdm=not args.disable_tqdm,
                     structured=args.structured_regex and (args.structured_regex,
                                                           args.structured_fraction))}
    print(f"Throughput: {out['requests_per_second']:.2f} requests/s, "
          f"{out['tokens_per_second']:.2f} total tokens/s, "
          f"{out['output_throughput']:.2f} output tokens/s")
    if "prefill_s" in out:
        print(f"prefill (every request's first token) {out['prefill_s']:.3f} s, median TTFT "
              f"{out['ttft_median_s']:.3f} s, decode {out.get('decode_tok_s', float('nan')):.1f}"
              f" tok/s; other processes took {out.get('foreign_cores', float('nan')):.2f} cores")
    if args.ceiling:
        model = out["model"]
        flops = None if model.endswith(".gguf") else ceilings.workload_flops(
            ceilings.param_counts(model), len(prompts), out["input_len"], args.output_len)
        batch1 = len(prompts) == 1 and "decode_tok_s" in out
        ceilings.report(out, model, flops=flops,
                        step_rate=out["decode_tok_s"] if batch1 else None)
    results.finish(args, out, "throughput", results.plot_throughput)
    return out
