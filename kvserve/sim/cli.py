"""`kvserve simulate`: flags and the command."""

from __future__ import annotations

import argparse

from kvserve.utils.cli_flags import add_balance_args, add_report_args, print_report

EPILOG = """examples:
  kvserve simulate --generator gsp --capacity 32k,64k,128k,256k --policy all --plot hit.png
  kvserve simulate --generator gsp --gen rate=20 --capacity 128k --replicas 1,2,4,8 \\
      --routing all --json
  kvserve simulate trace.jsonl --block-size 512 --capacity 1M --policy lru,belady
  kvserve simulate --generator multi_turn --lifetime immediate --alloc --max-model-len 8k
generators: system_prompt, few_shot, rag, multi_turn, gsp, hash_mix (options with --gen KEY=VALUE).
token counts: 8k = 8,192."""


def _names(text: str, allowed: tuple[str, ...], what: str,
           all_means: tuple[str, ...] | None = None) -> list[str]:
    if text == "all":
        return list(allowed if all_means is None else all_means)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{what} must be from {', '.join(allowed)} (or all), got {text!r}")
    return names


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", default=None, help="a JSONL trace (token ids or hash ids)")
    p.add_argument("--generator", default=None,
                   help="a built-in workload instead of a trace file")
    p.add_argument("--gen", action="append", metavar="KEY=VALUE",
                   help="a generator option, e.g. --gen num_groups=64 --gen rate=10")
    p.add_argument("--write-trace", metavar="FILE", default=None,
                   help="save the (generated) trace as JSONL")
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default 16; for hash-id traces the trace's block size)")
    p.add_argument("--trace-block-size", type=int, default=None,
                   help="tokens per hash id (default: the trace's meta line, else 512)")
    p.add_argument("--time-unit", choices=["ms", "s", "us"], default="ms",
                   help="unit of the trace's timestamps (Mooncake: ms)")
    p.add_argument("--capacity", default="128k",
                   help="KV pool per replica in tokens; a comma list sweeps it (e.g. 32k,64k)")
    p.add_argument("--policy", default="lru",
                   help="eviction policies: lru, lfu, priority, belady (offline) or all")
    p.add_argument("--replicas", default="1", help="replica counts, e.g. 1,2,4,8")
    p.add_argument("--routing", default="cache_aware",
                   help="random, round_robin, least_loaded, consistent_hash, cache_aware, or all "
                        "(the four of docs/planner.md: all but least_loaded)")
    p.add_argument("--lifetime", choices=["auto", "timed", "immediate"], default="auto",
                   help="timed: hold blocks from arrival to finish; immediate: one request at a "
                        "time (auto: timed when the trace has timestamps)")
    p.add_argument("--rate", type=float, default=None,
                   help="give a trace without timestamps Poisson arrivals at this rate (req/s)")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0)
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    add_balance_args(p, slack=0, slack_why=" here; kvserve route's is 4")
    p.add_argument("--alloc", action="store_true",
                   help="also compare contiguous preallocation with paged blocks")
    p.add_argument("--max-model-len", default=None,
                   help="contiguous preallocation length (default: longest request, rounded up "
                        "to a power of two)")
    p.add_argument("--alloc-block-sizes", default="16,32,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-tenant-quota", type=float, default=None, metavar="FRACTION",
                   help="bound each tenant's idle cached blocks as the server's flag does "
                   "(tenants: a record's tenant, else its cache_salt)")
    p.add_argument("--max-pinned-fraction", type=float, default=0.5,
                   help="most of the pool that records with pin: true may pin")
    add_report_args(p, "the results",
                    "hit rate vs capacity per policy; hit rate and imbalance vs replicas")


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvserve.planner.units import parse_token_list, parse_tokens
    from kvserve.router.policies import ALL_POLICIES, ROUTING_POLICIES
    from kvserve.sim.alloc import allocation_modes
    from kvserve.sim.generators import generate, parse_gen_options
    from kvserve.kv.eviction import EVICTION_POLICIES
    from kvserve.sim.replay import SimConfig, replay
    from kvserve.sim.report import format_report, plot_report
    from kvserve.sim.trace import load_trace, write_trace

    if (args.trace is None) == (args.generator is None):
        raise ValueError("give either a trace file or --generator NAME")
    if args.trace is not None:
        trace = load_trace(args.trace, args.trace_block_size, args.time_unit, args.limit)
    else:
        options = parse_gen_options(args.gen)
        options.setdefault("seed", args.seed)
        trace = generate(args.generator, **options)
        if args.limit is not None:
            trace.requests = trace.requests[: args.limit]
    if args.rate and not trace.has_timestamps:
        trace.with_poisson_arrivals(args.rate, args.seed)
    if args.write_trace:
        write_trace(trace, args.write_trace)
    lifetime = args.lifetime
    if lifetime == "auto":
        lifetime = "timed" if trace.has_timestamps else "immediate"
    block_size = args.block_size or (trace.block_size if trace.is_hash_trace else 16)
    capacities = parse_token_list(args.capacity)
    policies = _names(args.policy, tuple(EVICTION_POLICIES), "--policy")
    routings = _names(args.routing, ALL_POLICIES, "--routing", all_means=ROUTING_POLICIES)
    replica_counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    if not replica_counts or min(replica_counts) < 1:
        raise ValueError(f"--replicas must list positive counts, got {args.replicas!r}")

    def config(cap: int, policy: str, n: int, routing: str) -> SimConfig:
        return SimConfig(capacity_tokens=cap, block_size=block_size, policy=policy, replicas=n,
                         routing=routing, lifetime=lifetime,
                         decode_ms_per_token=args.decode_ms_per_token,
                         prefill_tokens_per_s=args.prefill_tokens_per_s,
                         balance_factor=args.balance_factor, balance_slack=args.balance_slack,
                         hash_key_tokens=args.hash_key_tokens, seed=args.seed,
                         tenant_quota=args.kv_tenant_quota,
                         max_pinned_fraction=args.max_pinned_fraction)

    runs = []
    for cap in capacities:
        for n in replica_counts:
            for policy in policies:
                if n == 1:
                    runs.append(replay(trace, config(cap, policy, 1, routings[0])))
                    continue
                if policy == "belady":
                    continue  # an offline reference for one cache only
                for routing in routings:
                    runs.append(replay(trace, config(cap, policy, n, routing)))
    if not args.json:
        for r in runs:
            del r["per_replica"]
    result = {"trace": trace.summary(), "runs": runs}
    if args.alloc:
        lengths = [r.input_length + r.output_length for r in trace.requests]
        if args.max_model_len:
            max_len = parse_tokens(args.max_model_len)
        else:
            max_len = 1 << (max(lengths) - 1).bit_length()
        cap = max(capacities)
        sizes = [int(x) for x in args.alloc_block_sizes.split(",") if x.strip()]
        result["allocation"] = dict(capacity_tokens=cap, max_model_len=max_len,
                                    modes=allocation_modes(lengths, cap, max_len, sizes))
    print_report(args, result, format_report, lambda path: plot_report(result, path))
    return 0
