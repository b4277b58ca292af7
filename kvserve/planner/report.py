"""The plan as a readable table, and its plots."""

from __future__ import annotations

from kvserve.planner.memory import KV_DTYPES, kv_bytes_per_request
from kvserve.planner.model import ModelSpec
from kvserve.planner.units import fmt_bytes, fmt_short


def _rows(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"{indent}{k:<{width}}  {v}" for k, v in rows]


def format_plan(plan: dict) -> str:
    m, kv, mem, cap = plan["model"], plan["kv"], plan["memory"], plan["capacity"]
    bt, fr = plan["block_table"], plan["fragmentation"]
    L, bs = kv["context_len"], kv["block_size"]
    if m["attention"] == "mla":
        shape = (f"MLA: {m['num_layers']} layers x (kv_lora_rank {m['kv_lora_rank']} + rope "
                 f"{m['qk_rope_head_dim']})")
    else:
        shape = (f"{m['attention'].upper()}: {m['num_layers']} layers x {m['num_kv_heads']} KV "
                 f"heads x head_dim {m['head_dim']} ({m['num_attention_heads']} query heads)")
    if m["sliding_window_layers"]:
        shape += (f"; {m['sliding_window_layers']} of {m['num_layers']} layers slide over "
                  f"{'/'.join(f'{w:,}' for w in m['sliding_windows'])} tokens")
    out = [f"kvserve plan: {m['name']} ({m['source']}), {m['architecture']}",
           f"  {shape}",
           f"  {m['num_params'] / 1e9:,.2f} B parameters ({m['params_source']}), "
           f"checkpoint dtype {m['dtype']}", ""]
    tp = f", tensor parallel {kv['tensor_parallel_size']} (per GPU)" \
        if kv["tensor_parallel_size"] > 1 else ""
    out.append(f"KV cache: {kv['dtype']}, context {L:,} tokens, block size {bs}{tp}")
    rows = [("per token, one layer", fmt_bytes(kv["bytes_per_token_per_layer"])),
            ("per token, all layers", fmt_bytes(kv["bytes_per_token"])),
            (f"per request ({L:,} tokens)", fmt_bytes(kv["bytes_per_request"])),
            (f"per block ({bs} tokens)", fmt_bytes(kv["bytes_per_block"]))]
    if kv["bytes_per_request_blocks"] != kv["bytes_per_request"]:
        rows.append(("per request, whole blocks", fmt_bytes(kv["bytes_per_request_blocks"])))
    if kv["scale_overhead_frac"]:
        rows.append(("quantization scales", f"+{kv['scale_overhead_frac'] * 100:.2f}% "
                     "(fp16 scale + zero point per group)"))
    out += _rows(rows) + [""]

    gpu = f"{mem['gpu']}: " if mem["gpu"] else ""
    out.append(f"Memory: {gpu}{fmt_bytes(mem['device_bytes'])} x utilization "
               f"{mem['gpu_memory_utilization']}")
    wf = mem["weight_format"] + (f", group {mem['weight_group_size']}"
                                 if mem["weight_group_size"] else "")
    if mem.get("quantization"):
        wf = f"quantization {mem['quantization']}, the engine's count"
    rows = [("usable", fmt_bytes(mem["usable_bytes"])),
            ("- weights (given)" if mem["weights_given"] else f"- weights ({wf})",
             fmt_bytes(mem["weight_bytes"])),
            ("- activation + framework reserve", fmt_bytes(mem["reserve_bytes"])),
            ("= KV pool", fmt_bytes(mem["kv_pool_bytes"]))]
    out += _rows(rows) + [""]

    out.append("Capacity")
    out.append(f"  KV cache size: {cap['kv_cache_tokens']:,} tokens ({cap['num_blocks']:,} "
               f"blocks), Maximum concurrency for {L:,} tokens per request: "
               f"{cap['max_concurrency']:.2f}x")
    out.append(f"  = {cap['max_concurrent_requests']:,} concurrent requests of {L:,} tokens")
    if cap.get("mla_saving"):
        out.append(f"  {cap['mla_saving']}")
    for room in cap["prefix_room"]:
        out.append(f"  with {room['concurrency']:,} running at full length, room left for "
                   f"cached prefixes: {room['tokens']:,} tokens ({room['frac'] * 100:.1f}% of "
                   "the pool)")
    out.append(f"  block table: {bt['bytes_per_request']:,} B per request "
               f"({bt['frac_of_request_kv'] * 100:.4f}% of its KV); "
               f"{fmt_short(bt['preallocated_bytes'])} for {bt['max_num_seqs']} sequence slots")
    out.append("")

    out.append(f"Fragmentation: lengths {fr['length_distribution']} (mean "
               f"{fr['mean_length']:,.1f} tokens), block size {bs}")
    rows = [("expected waste per request", f"{fr['expected_waste_tokens']:.1f} tokens"),
            ("of allocated KV memory", f"{fr['waste_frac_of_allocated'] * 100:.2f}%"),
            ("rule of thumb (half a block / mean)", f"{fr['rule_of_thumb'] * 100:.2f}%"),
            ("contiguous preallocation to context",
             f"{fr['contiguous_waste_frac'] * 100:.1f}% wasted, "
             f"{fr['contiguous_concurrency']:,.0f} concurrent"),
            ("paged, this distribution", f"~{fr['paged_concurrency']:,.0f} concurrent"),
            ("waste by block size", ", ".join(f"{b}: {v * 100:.2f}%"
                                             for b, v in fr["by_block_size"].items()))]
    out += _rows(rows) + [""]

    out.append(f"KV dtypes at {L:,} tokens (same weights and pool)")
    out.append(f"  {'dtype':<6} {'bytes/token':>12} {'per request':>14} {'max concurrency':>16}")
    for name, row in plan["dtypes"].items():
        mark = " <" if name == kv["dtype"] else ""
        out.append(f"  {name:<6} {row['bytes_per_token']:>12,} "
                   f"{fmt_short(row['bytes_per_request']):>14} "
                   f"{row['max_concurrency']:>15.2f}x{mark}")
    for w in plan["warnings"]:
        out.append(f"warning: {w}")
    return "\n".join(out)


def plot_plan(spec: ModelSpec, plan: dict, path: str, kv_group_size: int | None = None) -> None:
    """Two panels: KV bytes per request vs context length for every dtype (with the pool as a
    line), and maximum concurrency vs context length for every dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv, mem = plan["kv"], plan["memory"]
    tp, bs = kv["tensor_parallel_size"], kv["block_size"]
    top = max(spec.max_position_embeddings, kv["context_len"])
    lengths = []
    n = 256
    while n <= top:
        lengths.append(n)
        n *= 2
    if lengths[-1] != top:
        lengths.append(top)
    pool = plan["capacity"]["num_blocks"] * kv["bytes_per_block"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    pool_d = mem["kv_pool_bytes"] or pool
    for name in KV_DTYPES:
        if name == "bf16":
            continue  # the same bytes as fp16: one line for both
        label = "fp16 / bf16" if name == "fp16" else name
        per = [kv_bytes_per_request(spec, name, n, None, tp, kv_group_size, bs) for n in lengths]
        blk = [kv_bytes_per_request(spec, name, n, bs, tp, kv_group_size, bs) for n in lengths]
        style = "-" if name == kv["dtype"] or (name, kv["dtype"]) == ("fp16", "bf16") else "--"
        ax1.plot(lengths, [p / 2**30 for p in per], style, marker=".", label=label)
        ax2.plot(lengths, [pool_d / b if b else 0 for b in blk], style, marker=".", label=label)
    ax1.axhline(pool / 2**30, color="gray", lw=1)
    ax1.text(lengths[0], pool / 2**30, f" KV pool {pool / 2**30:.1f} GiB", va="bottom",
             fontsize=8, color="gray")
    ax1.axvline(kv["context_len"], color="gray", lw=0.8, ls=":")
    ax2.axvline(kv["context_len"], color="gray", lw=0.8, ls=":")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_ylabel("KV cache per request (GiB)")
    ax1.set_title(f"{spec.name}: KV memory per request")
    ax2.set_ylabel("max concurrent requests")
    ax2.set_title(f"concurrency in a {pool_d / 1e9:.1f} GB pool")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
