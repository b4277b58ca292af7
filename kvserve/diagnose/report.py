"""`kvserve diagnose`'s output: the ranked table, and the plot of hit rate per fix."""

from __future__ import annotations

from kvserve.diagnose.analyze import Diagnosis

_NOT_POLLUTION = {"first": "first of its prefix", "repeat": "exact repeats",
                  "extension": "extend an earlier prompt", "content": "differ in content"}


def _show(span: str, width: int = 28) -> str:
    """A span as one table cell: repr (whitespace visible), cut to `width`."""
    text = repr(span)
    return text if len(text) <= width else text[:width - 3] + "..."


def render_text(d: Diagnosis) -> str:
    """The ranked table, with the log's totals above it and what was not pollution below."""
    pool = d.pool
    lines = [f"{d.source}: {d.requests} requests, {d.prompt_tokens:,} prompt tokens; pool "
             f"{pool.pool_blocks:,} blocks of {pool.block_size} tokens ({pool.source})",
             f"prefix-cache hit rate, replayed: {100 * d.hit_rate:.1f}%"
             + (f" (the server reported {100 * d.served_hit_rate:.1f}%)"
                if d.served_hit_rate is not None else "")]
    if d.skipped:
        lines.append(f"note: {d.skipped} requests could not be rendered and are left out "
                     f"({d.skip_reason})")
    if d.overlapped:
        lines.append(f"note: {d.overlapped} requests arrived while an earlier one was running; "
                     "the replay sends them one after another, so it may credit hits that "
                     "concurrent requests could not have had")
    if not d.classes:
        lines.append("no pollution found: requests diverge where their content differs")
    else:
        header = f"{'class':<30} {'requests':>8}  {'example':<28} {'->':<28} " \
                 f"{'hit now':>7} {'fixed':>7} {'gain':>7}"
        lines += ["", header, "-" * len(header)]
        for c in d.classes:
            lines.append(f"{c.label:<30} {c.requests:>8}  {_show(c.example):<28} "
                         f"{_show(c.example_other):<28} {100 * c.hit_rate:>6.1f}% "
                         f"{100 * c.hit_rate_fixed:>6.1f}% {c.gain_points:>+6.1f}")
        lines.append(f"{'all of the above fixed':<30} {'':>8}  {'':<28} {'':<28} "
                     f"{100 * d.hit_rate:>6.1f}% {100 * d.hit_rate_all_fixed:>6.1f}% "
                     f"{100 * (d.hit_rate_all_fixed - d.hit_rate):>+6.1f}")
    rest = [f"{n} {_NOT_POLLUTION[k]}" for k, n in d.divergences.items()
            if k in _NOT_POLLUTION and n]
    if rest:
        lines += ["", "not pollution: " + ", ".join(rest)]
    lines.append("(gain: points of hit rate the fix brings back, replayed through the prefix "
                 "cache at this pool size; example: the span in a request -> in the request "
                 "it diverged from)")
    return "\n".join(lines)


def plot(d: Diagnosis, path: str) -> None:
    """Bars of the hit rate now, with each class fixed, and with all fixed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["as logged"] + [c.label for c in d.classes] + (["all fixed"] if d.classes else [])
    rates = [d.hit_rate] + [c.hit_rate_fixed for c in d.classes] + \
        ([d.hit_rate_all_fixed] if d.classes else [])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(names)), 4.0))
    colors = ["#888888"] + ["#3b7dd8"] * len(d.classes) + (["#2a9d55"] if d.classes else [])
    bars = ax.bar(range(len(names)), [100 * r for r in rates], color=colors)
    for bar, r in zip(bars, rates):
        ax.text(bar.get_x() + bar.get_width() / 2, 100 * r + 1, f"{100 * r:.1f}%",
                ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"hit rate per fix ({d.requests} requests, pool {d.pool.pool_blocks} x "
                 f"{d.pool.block_size} tokens)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
