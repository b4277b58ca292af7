"""`kvserve make-model | generate | demo | serve | route | plan | simulate | diagnose | bench`: the
command line, with vLLM's flag names."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from typing import Any

from kvserve.config import EngineConfig


DEMO_PROMPTS = [
    "The capital of France is",
    "A paged KV cache stores keys and values in",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One argument per `EngineConfig` field, under vLLM's --kebab-case name, with the field's
    default, type, choices and help: adding or changing a field changes its flag with it.
    Booleans are --x / --no-x; `model` is the optional positional MODEL."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        settings = dict(f.metadata)
        aliases = settings.pop("aliases", ())
        if settings.pop("positional", False):
            parser.add_argument(f.name, nargs="?", default=f.default, **settings)
            continue
        if hints[f.name] is bool:
            settings["action"] = argparse.BooleanOptionalAction
            settings["help"] += f" (default: {'on' if f.default else 'off'})"
        else:
            settings["type"] = _scalar_type(hints[f.name])
        parser.add_argument("--" + f.name.replace("_", "-"), *aliases, default=f.default,
                            **settings)


def _scalar_type(hint: Any) -> type:
    """int for `int | None`, str for `Any`: what argparse converts a flag's value with."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1:
        hint = args[0]
    return hint if hint in (int, float, str) else str


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from what `add_engine_args` parsed."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def cmd_make_model(args: argparse.Namespace) -> int:
    from kvserve.model_loader.make_model import make_model

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


def cmd_demo(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.demo import DemoOptions, run_demo
    from kvserve.utils.logging_setup import init_logging

    init_logging()  # the engine's start-up lines (the KV capacity line among them)
    run_demo(DemoOptions(max_tokens=args.max_tokens,
                         engine_kwargs=engine_kwargs(args)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.launch import run_server

    return run_server(args, engine_kwargs(args))


def cmd_route(args: argparse.Namespace) -> int:
    from kvserve.router.launch import run_router

    return run_router(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.models.registry import MAKE_ARCHS  # every registered architecture (no torch)

    mk = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    mk.add_argument("dir")
    mk.add_argument("--arch", choices=MAKE_ARCHS, default="qwen2")
    mk.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    mk.set_defaults(func=cmd_make_model)

    gen = sub.add_parser("generate", help="generate from prompts (default: a few demo prompts)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="what kvserve is for, in one screen: chat answers "
                          "streamed from the server, a long system prompt served from the prefix "
                          "cache, fp8/int8 KV")
    demo.add_argument("--max-tokens", type=int, default=64)
    add_engine_args(demo)
    # A 256 MiB pool (about 11k tokens of SmolLM2's float32 KV) starts in a blink; the engine's
    # default pool is sized for serving and takes seconds to allocate on a small machine.
    demo.set_defaults(func=cmd_demo, kv_cache_memory_bytes=256 << 20, max_model_len=4096)

    from kvserve.server.args import add_server_args

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(srv)
    add_server_args(srv)
    srv.set_defaults(func=cmd_serve)

    from kvserve.router.launch import add_route_args

    route = sub.add_parser("route", help="a prefix-aware OpenAI-compatible gateway in front of "
                           "several `kvserve serve` replicas")
    add_route_args(route)
    route.set_defaults(func=cmd_route)

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

    from kvserve.diagnose.cli import EPILOG as DIAG_EPILOG, add_diagnose_args, cmd_diagnose

    diag = sub.add_parser("diagnose", help="why a request log misses the prefix cache: "
                          "polluting spans, ranked by the hit rate their fix brings back",
                          epilog=DIAG_EPILOG, formatter_class=raw)
    add_diagnose_args(diag)
    diag.set_defaults(func=cmd_diagnose)

    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args, engine_kwargs)
    return parser


def route_parser() -> argparse.ArgumentParser:
    """`kvserve route` alone: the gateway never builds the other commands' parsers, whose
    imports (the planner's) bring torch into a process that has no use for it."""
    from kvserve.router.launch import add_route_args

    parser = argparse.ArgumentParser(prog="kvserve route")
    add_route_args(parser)
    parser.set_defaults(func=cmd_route)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["route"] and not {"-h", "--help"} & set(argv[1:]):
        args = route_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
