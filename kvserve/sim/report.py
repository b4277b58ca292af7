"""The simulator's table and plots."""

from __future__ import annotations


def _tok(n: int) -> str:
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return f"{n:,}"


def format_report(result: dict) -> str:
    tr = result["trace"]
    out = [f"trace: {tr['source']}: {tr['num_requests']:,} requests, "
           f"{tr['input_tokens']:,} prompt tokens (mean {tr['mean_input_length']:,.0f}), "
           f"{tr['output_tokens']:,} output tokens"
           + (f", {tr['duration_s']:,.0f} s" if tr.get("duration_s") else "")
           + (f", hash blocks of {tr['hash_block_size']}" if tr.get("hash_block_size") else "")]
    runs = result["runs"]
    if runs:
        out.append("")
        head = (f"{'policy':<9} {'capacity':>9} {'repl':>4} {'routing':<15} {'hit rate':>8} "
                f"{'saved tokens':>13} {'evicted':>9} {'peak use':>8} {'imbal':>6} "
                f"{'rejected':>8} {'req/s':>8}")
        out.append(head)
        out.append("-" * len(head))
        for r in runs:
            out.append(f"{r['policy']:<9} {_tok(r['capacity_tokens']):>9} {r['replicas']:>4} "
                       f"{(r['routing'] or '-'):<15} {r['hit_rate'] * 100:>7.2f}% "
                       f"{r['prefill_tokens_saved']:>13,} {r['evicted_blocks']:>9,} "
                       f"{r['peak_usage'] * 100:>7.1f}% {r['imbalance']:>6.2f} "
                       f"{r['rejected']:>8,} {r['requests_per_s']:>8,.0f}")
        lifetimes = {r["lifetime"] for r in runs}
        out.append(f"(block size {runs[0]['block_size']}; lifetime {', '.join(sorted(lifetimes))};"
                   " capacity per replica; imbal = busiest replica's requests / mean)")
    if result.get("allocation"):
        a = result["allocation"]
        out.append("")
        out.append(f"allocation modes: {a['capacity_tokens']:,}-token pool, max_model_len "
                   f"{a['max_model_len']:,}, trace lengths (prompt + output)")
        out.append(f"  {'mode':<12} {'block':>6} {'max concurrency':>16} {'wasted':>8} "
                   f"{'expected':>9}")
        for row in a["modes"]:
            out.append(f"  {row['mode']:<12} {row['block_size']:>6,} "
                       f"{row['max_concurrency']:>16,} {row['wasted_frac'] * 100:>7.2f}% "
                       f"{row['expected_wasted_frac'] * 100:>8.2f}%")
    return "\n".join(out)


def plot_report(result: dict, path: str) -> None:
    """Panels as the runs allow: hit rate vs capacity per eviction policy; hit rate and load
    imbalance vs replicas per routing policy; allocation modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    single = [r for r in runs if r["replicas"] == 1]
    capacities = sorted({r["capacity_tokens"] for r in single})
    multi_counts = sorted({r["replicas"] for r in runs})
    panels = []
    if len(capacities) > 1:
        panels.append("capacity")
    if len(multi_counts) > 1:
        panels += ["replicas_hit", "replicas_imbalance"]
    if result.get("allocation"):
        panels.append("allocation")
    if not panels:
        panels.append("bars")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    title = result["trace"]["source"]
    for ax, panel in zip(axes[0], panels):
        if panel == "capacity":
            markers = iter(("o", "s", "^", "D", "v", "x"))
            for k, pol in enumerate(dict.fromkeys(r["policy"] for r in single)):
                pts = sorted((r["capacity_tokens"], r["hit_rate"]) for r in single
                             if r["policy"] == pol)
                # equal curves (priority without priorities is lru) stay visible: markers shrink
                ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], marker=next(markers),
                        markersize=9 - 1.5 * k, ls="--" if pol == "belady" else "-", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xticks(capacities, [_tok(c) for c in capacities])
            ax.set_xlabel("cache capacity (tokens)")
            ax.set_ylabel("prefix hit rate (% of prompt tokens)")
            ax.set_title("hit rate vs capacity")
        elif panel in ("replicas_hit", "replicas_imbalance"):
            key = "hit_rate" if panel == "replicas_hit" else "imbalance"
            cap = max(r["capacity_tokens"] for r in runs)
            base = [r for r in single if r["capacity_tokens"] == cap]
            routings = list(dict.fromkeys(r["routing"] for r in runs if r["routing"]))
            for routing in routings:
                pts = [(r["replicas"], r[key]) for r in runs
                       if r["routing"] == routing and r["capacity_tokens"] == cap]
                pts += [(1, b[key]) for b in base[:1]]
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] * (100 if key == "hit_rate" else 1)
                                              for p in pts], marker="o", label=routing)
            ax.set_xscale("log", base=2)
            ax.set_xticks(multi_counts, [str(n) for n in multi_counts])
            ax.set_xlabel("replicas")
            if key == "hit_rate":
                ax.set_ylabel("prefix hit rate (% of prompt tokens)")
                ax.set_title(f"hit rate vs replicas ({_tok(cap)} tokens each)")
            else:
                ax.set_ylabel("load imbalance (max / mean requests)")
                ax.set_title("load imbalance vs replicas")
                ax.axhline(1.0, color="gray", lw=0.8)
        elif panel == "allocation":
            modes = result["allocation"]["modes"]
            names = [m["mode"] for m in modes]
            ax.bar(names, [m["max_concurrency"] for m in modes], color="tab:blue")
            ax.set_ylabel("max concurrent requests")
            ax2 = ax.twinx()
            ax2.plot(names, [m["wasted_frac"] * 100 for m in modes], "o-", color="tab:red")
            ax2.set_ylabel("wasted KV memory (%)", color="tab:red")
            ax.set_title("contiguous vs paged allocation")
        else:
            labels = [f"{r['policy']}/{r['replicas']}" for r in runs]
            ax.bar(labels, [r["hit_rate"] * 100 for r in runs])
            ax.set_ylabel("prefix hit rate (%)")
            ax.set_title("hit rate per run")
        if panel != "allocation" and panel != "bars":
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
