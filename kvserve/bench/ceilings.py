"""The machine's own limits, measured in the same run as the figure they judge: a throughput
figure means little across machines, its share of what this machine can do at that moment
means more. Three yardsticks:

- the matmul ceiling: GFLOP/s of a 2048 x 2048 fp32 (and, with bf16 instructions, bf16)
  matmul; a batched workload's FLOPs / its wall time is its share;
- the read bandwidth of a weight-sized buffer: a batch-1 decode reads every weight once per
  token, so weight bytes x tok/s / bandwidth is its share (where the weights fit in the L3,
  that is L3 bandwidth, not DRAM: a DRAM copy figure would understate what is reachable);
- the GEMM ceiling of a model's own projections at the best kernel per shape (the engine's
  candidates: MKL, packed oneDNN, kvserve's GEMV), summed over a workload's steps.

`kvserve bench latency|throughput --ceiling` report the first two; benchmarks/ add the third.
"""

from __future__ import annotations

import json
import statistics
import struct
import time
from pathlib import Path


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def param_counts(model_dir: Path) -> dict:
    """Parameters by role, from config.json and the safetensors headers: what the FLOP and
    byte counts below multiply (the LM head counts whether tied or not: it does the work)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    numel = {k: _prod(v) for k, v in safetensors_shapes(model_dir).items()
             if not k.endswith("rotary_emb.inv_freq")}
    total = sum(numel.values())
    embed = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    head_stored = sum(v for k, v in numel.items() if k.endswith("lm_head.weight"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return {"total_stored": total, "embedding": embed,
            "non_embedding": total - embed - head_stored,
            "lm_head": cfg["vocab_size"] * cfg["hidden_size"],
            "tied": bool(cfg.get("tie_word_embeddings", False)),
            "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4}


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def weight_bytes(model: str | Path, bytes_per_param: int = 4) -> int:
    """Bytes a batch-1 decode step reads: a GGUF file's tensor bytes (its block formats), or
    every layer's weights and the LM head of a checkpoint at `bytes_per_param`."""
    if str(model).endswith(".gguf"):
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(model)).tensors)
    p = param_counts(Path(model))
    return bytes_per_param * (p["non_embedding"] + p["lm_head"])


def workload_flops(params: dict, n_prompts: int, prompt_len: int, gen: int) -> float:
    """2 x non-embedding params per token (prompt + generated) + 2 x LM head per generated
    token (the last prompt position and each decode step are the only rows with logits)."""
    return n_prompts * (2.0 * params["non_embedding"] * (prompt_len + gen)
                        + 2.0 * params["lm_head"] * gen)


def matmul_gflops(samples: int = 9, n: int = 2048) -> dict[str, float]:
    """dtype -> median GFLOP/s of an n x n matmul; bf16 only with bf16 instructions (emulated,
    a 2048^3 matmul does not finish in minutes)."""
    import torch

    from kvserve.kernels.cpu.cpu_features import cpu_info

    out = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if dt is torch.bfloat16 and not cpu_info().has_bf16:
            continue
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        c = torch.empty(n, n, dtype=dt)
        for _ in range(3):
            torch.mm(a, b, out=c)
        out[name] = statistics.median(2.0 * n ** 3 / _seconds(lambda: torch.mm(a, b, out=c))
                                      / 1e9 for _ in range(samples))
    return out


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_gbps(samples: int = 9, mib: int = 256) -> float:
    """Median copy bandwidth of a `mib` MiB buffer (far beyond a VM slice's caches), bytes read
    + written: the DRAM figure."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(8 * src.numel() / _seconds(lambda: dst.copy_(src)) / 1e9
                             for _ in range(samples))


def read_gbps(nbytes: int, samples: int = 9) -> float:
    """Median read bandwidth of a buffer of `nbytes`, each sample one pass after two warm ones:
    kvserve's C++ read kernel (csrc/gemv.cpp) on torch's threads, torch.sum without a
    compiler."""
    import torch

    from kvserve.kernels.cpu import gemv

    buf = torch.ones(max(nbytes // 4, 1 << 16))
    kernel = gemv.load()
    read = (lambda: kernel.read_sum(buf)) if kernel is not None else (lambda: float(buf.sum()))
    read()
    read()
    return statistics.median(buf.numel() * 4 / _seconds(read) / 1e9 for _ in range(samples))


def gemm_seconds(model_dir: str, rows: list[int], samples: int = 5) -> dict:
    """{"layers": L, "rows": {rows: {projection: best seconds per call}}}: the model's own
    projections (qkv, o, gate/up + SwiGLU, down; LM head) at the fastest of the engine's
    candidate kernels for that shape, min over `samples`."""
    import torch

    from kvserve.layers.gemm_select import time_once
    from kvserve.layers.selection import gemm_candidates
    from kvserve.worker.model_build import load_model

    model, config = load_model(model_dir, "float32", pack_weights=False)
    cands = gemm_candidates(model.layers[0], model.head_weight(), layer_ops=False)
    out: dict = {"layers": config.num_hidden_layers, "rows": {}}
    with torch.inference_mode():
        for n in sorted(set(rows)):
            per = out["rows"][str(n)] = {}
            for proj, kernels in cands.items():
                best = float("inf")
                for factory in kernels.values():
                    run = factory(n)
                    if run is None:  # a kernel not offered for this many rows (gemv)
                        continue
                    run()
                    calls = max(1, min(20, int(2e-3 / max(time_once(run, 1), 1e-7))))
                    best = min(best, *(time_once(run, calls) for _ in range(samples)))
                per[proj] = best
    return out


def gemm_ceiling_seconds(gemm: dict, n: int, plen: int, gen: int, max_batched: int) -> float:
    """Seconds a workload's projections alone take at the best kernel per shape: the prefill
    in steps of max_batched rows (LM head on the n sampled rows), then gen - 1 decode steps of
    n rows (all layers + LM head)."""
    rows_of = gemm["rows"]

    def step(rows: int) -> float:
        return gemm["layers"] * sum(rows_of[str(rows)][p] for p in ("qkv", "o", "mlp", "down"))

    total, left = 0.0, n * plen
    full = min(n * plen, max_batched)
    while left > 0:
        total += step(full) * min(left, max_batched) / full  # the last chunk pro rata
        left -= max_batched
    return total + rows_of[str(n)]["head"] + (gen - 1) * (step(n) + rows_of[str(n)]["head"])


def add_ceiling_arg(p) -> None:
    p.add_argument("--ceiling", action="store_true",
                   help="also measure this machine's matmul ceiling and the read bandwidth of "
                        "a weight-sized buffer after the run, and report the run's share")


def report(out: dict, model: str, *, flops: float | None = None,
           step_rate: float | None = None, samples: int = 9) -> dict:
    """Measure the ceilings now (after the run, on the same threads) and add the run's shares
    to `out`: a workload's `flops` over its wall time against the fp32 matmul ceiling, a
    batch-1 decode's `step_rate` (steps/s) x weight bytes against the read bandwidth."""
    c: dict = {"matmul_gflops": matmul_gflops(samples)}
    if flops is not None:
        c["gflops"] = flops / out["elapsed_time"] / 1e9
        c["frac_matmul"] = c["gflops"] / c["matmul_gflops"]["float32"]
        print(f"{c['gflops']:.1f} GFLOP/s = {100 * c['frac_matmul']:.1f}% of this machine's fp32"
              f" matmul ceiling ({c['matmul_gflops']['float32']:.0f} GFLOP/s, measured now)")
    if step_rate is not None:
        c["weight_bytes"] = weight_bytes(model)
        c["read_gbps"] = read_gbps(c["weight_bytes"], samples)
        c["frac_read"] = step_rate * c["weight_bytes"] / (c["read_gbps"] * 1e9)
        print(f"decode steps/s x {c['weight_bytes'] / 1e6:.0f} MB of weights = "
              f"{100 * c['frac_read']:.1f}% of the read bandwidth of a weight-sized buffer "
              f"({c['read_gbps']:.1f} GB/s, measured now)")
    out["ceiling"] = c
    return c
