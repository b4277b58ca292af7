"""`kvserve diagnose LOG`: the flags and the command."""

from __future__ import annotations

import argparse

from kvserve.utils.cli_flags import add_report_args, print_report

EPILOG = """\
LOG is kvserve's request log (`kvserve serve --request-log FILE`) or OpenAI-format JSONL of
/v1/chat/completions or /v1/completions bodies (batch-API lines {"body": {...}} too). The pool
replayed at is --pool-blocks, else the one in the request log's header (the server's), else one
that holds every prompt. Example:

  kvserve serve --request-log requests.jsonl
  kvserve diagnose requests.jsonl --plot fixes.png
"""


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="request log (JSONL)")
    p.add_argument("--model", default=None,
                   help="model directory or GGUF file whose tokenizer and chat template render "
                   "the requests (default: the embedded default model, as `kvserve serve`)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the request log's, else 16)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: the request log's, else unbounded)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N requests")
    add_report_args(p, "the diagnosis", "plot the hit rate per fix to FILE.png")


def cmd_diagnose(args: argparse.Namespace) -> int:
    from kvserve.diagnose.analyze import diagnose
    from kvserve.diagnose.log import read_log
    from kvserve.diagnose.render import load_tokenizer
    from kvserve.diagnose.report import plot, render_text

    for flag in ("block_size", "pool_blocks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    log = read_log(args.log, args.limit)
    tokenizer = load_tokenizer(args.model)
    progress = None
    if not args.json:
        from functools import partial

        from tqdm import tqdm

        progress = partial(tqdm, desc="replaying fixes", leave=False)
    result = diagnose(log, tokenizer, args.block_size, args.pool_blocks, progress)
    print_report(args, result.to_dict(), lambda _: render_text(result),
                 lambda path: plot(result, path))
    return 0
