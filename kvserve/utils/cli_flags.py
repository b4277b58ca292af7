"""Flags that more than one subcommand takes, spelled once so that a flag means the same in each.

`kvserve route` and `kvserve simulate` drive the same routing policies (router/policies.py), so
they take the same bounded-load flags; `kvserve plan` and `kvserve simulate` both print a
result as text or JSON and can plot it. Only the standard library here: the gateway builds its
parser without the planner's or the model's imports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def add_balance_args(p: argparse.ArgumentParser, slack: int, slack_why: str = "") -> None:
    """The bounds cache_aware and consistent_hash keep loads within (`make_policy`'s
    balance_factor, balance_slack and key_tokens); `slack` is the command's default."""
    p.add_argument("--balance-factor", type=float, default=1.25,
                   help="bounded loads: a replica may take a request while its in-flight load "
                   "stays within ceil(factor x (total + 1) / replicas) (default 1.25)")
    p.add_argument("--balance-slack", type=int, default=slack,
                   help="... or while it stays within this many requests of the least loaded "
                   f"replica (default {slack}{slack_why})")
    p.add_argument("--hash-key-tokens", type=int, default=256,
                   help="consistent_hash: the prefix (in tokens, whole blocks) that picks the "
                   "replica (default 256)")


def add_report_args(p: argparse.ArgumentParser, what: str, plot_help: str) -> None:
    """--json and --plot, for a command whose result `print_report` prints."""
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None, help=plot_help)


def print_report(args: argparse.Namespace, result: Any, text: Callable[[Any], str],
                 plot: Callable[[str], None]) -> None:
    """`result` as JSON (--json) or as `text` makes it, then `plot` to the --plot file if one
    was given; the note that says so goes to stderr under --json, so that stdout stays one JSON
    document a script can read."""
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(text(result))
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
