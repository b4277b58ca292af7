"""`kvserve bench latency | throughput | serve | prefix | kernels | soak`: the subcommands'
parsers. The offline ones take the engine flags of `kvserve generate` (MODEL, --dtype,
--num-threads, ...)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

EPILOG = """examples:
  kvserve bench serve --num-prompts 100 --request-rate 10          # starts kvserve serve
  kvserve bench serve --base-url http://127.0.0.1:8080 --prompt-format text \\
      --dataset-name prefix_repetition --max-concurrency 8 --save-result
  kvserve bench serve --base-url URL --dataset-name multi_turn --num-prompts 16
  kvserve bench latency MODEL --input-len 128 --output-len 128 --batch-size 1
  kvserve bench throughput MODEL --num-prompts 64 --input-len 128 --output-len 128
  kvserve bench prefix MODEL --prefix-lens 512,2048 --plot ttft.png
  kvserve bench perplexity model.gguf --files wiki.test.raw --context 512
  kvserve bench kernels --kernel attention --cases 1x4000 --query-rows 1,5 --layers 30
  kvserve bench soak --minutes 30 --concurrency 256 --abort-fraction 0.25 --out-dir soak/
"""


def _run(module: str) -> Callable[[argparse.Namespace], int]:
    def cmd(args: argparse.Namespace) -> int:
        import importlib

        status = importlib.import_module(f"kvserve.bench.{module}").run(args)
        return status if isinstance(status, int) else 0  # soak: 1 when RSS is not flat

    return cmd


def add_bench_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None],
                     engine_kwargs: Callable[[argparse.Namespace], dict]) -> None:
    """The subcommands under `sub`; the offline ones with kvserve.entrypoints.cli's engine flags
    (`add_engine_args`, read back by `engine_kwargs`: this package does not import the CLI)."""
    from kvserve.bench.kernels import add_kernels_args
    from kvserve.bench.latency import add_latency_args
    from kvserve.bench.perplexity import add_perplexity_args
    from kvserve.bench.prefix import add_prefix_args
    from kvserve.bench.serve import add_serve_args
    from kvserve.bench.soak import add_soak_args
    from kvserve.bench.throughput import add_throughput_args

    raw = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, prefix "
                           "(vLLM's `vllm bench` flags), perplexity, kernels, soak",
                           epilog=EPILOG, formatter_class=raw)
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    doc = {name: __import__(f"kvserve.bench.{name}", fromlist=["__doc__"]).__doc__
           for name in ("latency", "throughput", "serve", "prefix", "perplexity",
                         "kernels", "soak")}
    for name, add, offline in (("latency", add_latency_args, True),
                               ("throughput", add_throughput_args, True),
                               ("serve", add_serve_args, False),
                               ("prefix", add_prefix_args, True),
                               ("perplexity", add_perplexity_args, True),
                               ("kernels", add_kernels_args, False),
                               ("soak", add_soak_args, False)):
        p = bsub.add_parser(name, help=doc[name].split("\n\n")[0].split(": ", 1)[-1],
                            description=doc[name], formatter_class=raw)
        add(p)
        if offline:
            add_engine_args(p)
        p.set_defaults(func=_run(name), engine_kwargs=engine_kwargs)
