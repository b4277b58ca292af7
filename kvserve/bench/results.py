"""A benchmark's result: printed by its command, saved as JSON (vLLM's --save-result,
--result-dir, --result-filename, --metadata; --output-json for the offline ones) and plotted
(--plot FILE.png, matplotlib)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path


def add_result_args(p, plot_help: str) -> None:
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-dir", default=None, help="where (default: the current directory)")
    p.add_argument("--result-filename", default=None,
                   help="file name (default: <kind>-<label>-<date>.json)")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="write the result as JSON to PATH (as `vllm bench latency/throughput`)")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="pairs recorded in the JSON (e.g. version=0.1 tp=1)")
    p.add_argument("--label", default=None, help="the name the result is filed under")
    p.add_argument("--plot", default=None, metavar="FILE.png", help=plot_help)


def result_path(args: argparse.Namespace, kind: str, when: datetime) -> Path | None:
    if args.output_json:
        return Path(args.output_json)
    if not args.save_result:
        return None
    name = args.result_filename
    if not name:
        label = args.label or getattr(args, "backend", None) or "kvserve"
        model = Path(str(getattr(args, "model", None) or "default")).name
        parts = [kind, label]
        if kind == "serve":
            parts.append(f"{args.request_rate}qps")
            if args.max_concurrency:
                parts.append(f"concurrency{args.max_concurrency}")
        name = "-".join(parts + [model, when.strftime("%Y%m%d-%H%M%S")]) + ".json"
    return Path(args.result_dir or ".") / name


def _clean(v):
    """NaN and inf as null: strict JSON readers refuse them."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def finish(args: argparse.Namespace, out: dict, kind: str,
           plot: Callable[[dict, Path], None] | None = None) -> None:
    """Stamp the result, then save and plot it as the flags ask."""
    when = datetime.now()
    out.setdefault("date", when.strftime("%Y%m%d-%H%M%S"))
    out["kind"] = kind
    if args.label:
        out["label"] = args.label
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE pairs, not {pair!r}")
        out[key] = value
    path = result_path(args, kind, when)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_clean(out), indent=1))
        print(f"wrote {path}", file=sys.stderr)
    if args.plot and plot is not None:
        plot(out, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    fig.clf()


def plot_serve(out: dict, path: Path) -> None:
    """CDFs of TTFT, ITL and E2E latency over the successful requests."""
    plt = _pyplot()
    ok = [i for i, e in enumerate(out["errors"]) if not e]
    series = {"TTFT": [out["ttfts"][i] * 1e3 for i in ok],
              "ITL": [x * 1e3 for i in ok for x in out["itls"][i]],
              "E2E latency": [out["e2els"][i] * 1e3 for i in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=110)
    for ax, (name, vals) in zip(axes, series.items()):
        vals = sorted(vals)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], color="#4c72b0")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.set_title(name)
    fig.suptitle(f"{out.get('label') or out['backend']} {out['base_url']}: "
                 f"{out['dataset_name']}, {out['num_prompts']} prompts, "
                 f"{out['request_rate']} req/s", fontsize=10)
    _save(fig, path)
    plt.close(fig)


def plot_latencies(out: dict, path: Path) -> None:
    """`bench latency`: the measured iterations' latencies, a histogram with the percentiles."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.hist(out["latencies"], bins=min(30, max(5, len(out["latencies"]))), color="#4c72b0")
    for k, v in out["percentiles"].items():
        ax.axvline(v, color="#c44e52", linestyle="--", linewidth=1)
        ax.text(v, ax.get_ylim()[1] * 0.95, f" p{k}", color="#c44e52", fontsize=8, va="top")
    ax.set_xlabel("latency of one batch (s)")
    ax.set_ylabel("iterations")
    ax.set_title(f"batch {out['batch_size']}, {out['input_len']} -> {out['output_len']} tokens",
                 fontsize=10)
    _save(fig, path)
    plt.close(fig)


def plot_throughput(out: dict, path: Path) -> None:
    """`bench throughput`: request completion over time (finished requests vs seconds)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    done = sorted(out["finish_times"])
    ax.step(done, range(1, len(done) + 1), where="post", color="#4c72b0")
    ax.set_xlabel("seconds since the batch was submitted")
    ax.set_ylabel("finished requests")
    ax.set_title(f"{out['num_requests']} x {out['input_len']} -> {out['output_len']} tokens: "
                 f"{out['output_throughput']:.1f} output tok/s", fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)


def plot_prefix(rows: list[dict], path: Path, title: str) -> None:
    """TTFT cold vs cached per prefix length (rows: prefix_len, suffix_len, cold and cached as
    {median, min, max}, reduction, speedup): bars on a log scale, the reduction annotated."""
    plt = _pyplot()
    from matplotlib import ticker

    rows = [r for r in rows if r.get("cold") and r.get("cached")]
    if not rows:
        return
    x = list(range(len(rows)))
    width = 0.38
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for off, mode, color, label in ((-width / 2, "cold", "#c44e52", "cold (prefix cache reset)"),
                                    (width / 2, "cached", "#4c72b0", "cached prefix")):
        med = [1e3 * r[mode]["median"] for r in rows]
        err = [[m - 1e3 * r[mode]["min"] for m, r in zip(med, rows)],
               [1e3 * r[mode]["max"] - m for m, r in zip(med, rows)]]
        bars = ax.bar([i + off for i in x], med, width, yerr=err, capsize=3, color=color,
                      label=label, error_kw={"elinewidth": 1, "ecolor": "#333333"})
        for b, m in zip(bars, med):
            ax.text(b.get_x() + b.get_width() / 2, m / 1.6, f"{m:.0f} ms" if m >= 10 else
                    f"{m:.1f} ms", ha="center", va="top", fontsize=8, color="white",
                    fontweight="bold")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_ylim(min(1e3 * r["cached"]["min"] for r in rows) / 3,
                max(1e3 * r["cold"]["max"] for r in rows) * 4)
    for i, r in enumerate(rows):
        change = "lower" if r["reduction"] >= 0 else "higher"
        ax.annotate(f"{abs(100 * r['reduction']):.1f}% {change}\n({r['speedup']:.1f}x faster)",
                    xy=(i, 1e3 * r["cold"]["max"] * 1.25), ha="center", va="bottom",
                    fontsize=10, fontweight="bold")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['prefix_len']:,}" for r in rows])
    ax.set_xlabel(f"cached prefix length (tokens), + {rows[0].get('suffix_len', 64)}-token "
                  "unique suffix, 1 generated token")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=9)
    ax.grid(axis="y", which="both", alpha=0.25)
    _save(fig, path)
    plt.close(fig)
