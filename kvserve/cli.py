"""`kvserve make-model | generate | serve`: the command line, with vLLM's flag names."""

from __future__ import annotations

import argparse
import sys
import time

from kvserve.kv.eviction import ONLINE_POLICIES

DEMO_PROMPTS = [
    "The capital of France is",
    "A paged KV cache stores keys and values in",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names; defaults come from EngineConfig."""
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16", "half", "bf16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV of shared prompt prefixes "
                        "(default: on; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--eviction-policy", choices=ONLINE_POLICIES, default="lru",
                        help="which idle cached blocks are evicted first")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "lpm"], default="fcfs",
                        help="lpm: waiting requests with the longest cached prefix first")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                        help="where the model and the KV cache live (default: auto = cuda when "
                        "a GPU is visible, else cpu)")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                        default="auto", help="auto: triton on cuda, torch on cpu")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode batches")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch intra-op threads on CPU (default: torch's choice)")
    parser.add_argument("--kv-tier-config", default=None, metavar="FILE_OR_JSON",
                        help="storage tiers under the KV pool (host memory, disk, Redis): a YAML "
                        "file with LMCache's keys (chunk_size, local_cpu, max_local_cpu_size, "
                        "local_disk, max_local_disk_size, remote_url, remote_serde, ...) or the "
                        "same as a JSON string")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                num_threads=args.num_threads, enable_prefix_caching=args.enable_prefix_caching,
                eviction_policy=args.eviction_policy, scheduling_policy=args.scheduling_policy,
                device=args.device, attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager, kv_tier_config=args.kv_tier_config)


def cmd_make_model(args: argparse.Namespace) -> int:
    from kvserve.model.make_model import make_model

    path = make_model(args.dir, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype)
    print(f"wrote a random-weight {args.arch} ({args.size}) checkpoint to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    prompts = args.prompt or DEMO_PROMPTS
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t1
    total_out = 0
    for out in outputs:
        c = out.outputs[0]
        total_out += len(c.token_ids)
        ttft = out.metrics.ttft or 0.0
        print(f"\nPrompt: {out.prompt!r}\nOutput: {c.text!r}\n  {len(out.prompt_token_ids)} prompt"
              f" tokens, {len(c.token_ids)} generated, finish_reason={c.finish_reason}, "
              f"TTFT {ttft * 1000:.1f} ms")
    print(f"\nmodel {llm.engine.config.model}: loaded in {load_s:.2f} s; {len(outputs)} prompts, "
          f"{total_out} tokens generated in {gen_s:.2f} s ({total_out / gen_s:.1f} tok/s)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.launch import run_server

    return run_server(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    mk.add_argument("dir")
    mk.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "mistral"], default="qwen2")
    mk.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    mk.set_defaults(func=cmd_make_model)

    gen = sub.add_parser("generate", help="generate from prompts (default: a few demo prompts)")
    gen.add_argument("model", nargs="?", default=None,
                     help="checkpoint directory (default: the embedded default model)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from kvserve.server.args import add_server_args

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("model", nargs="?", default=None,
                     help="checkpoint directory (default: the embedded default model)")
    add_engine_args(srv)
    add_server_args(srv)
    srv.set_defaults(func=cmd_serve)

    from kvserve.planner.cli import EPILOG as PLAN_EPILOG, add_plan_args, cmd_plan
    from kvserve.sim.cli import EPILOG as SIM_EPILOG, add_simulate_args, cmd_simulate

    raw = argparse.RawDescriptionHelpFormatter
    plan = sub.add_parser("plan", help="KV-cache memory and concurrency for a model and a GPU",
                          epilog=PLAN_EPILOG, formatter_class=raw)
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    sim = sub.add_parser("simulate", help="replay a request trace through the prefix cache",
                         epilog=SIM_EPILOG, formatter_class=raw)
    add_simulate_args(sim)
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
