"""`kvserve bench kernels`: micro-benchmarks of the CPU kernels, each path beside the one it
replaces, one timing harness for all: paths interleaved (the order alternating per round, so
that a shared machine's drift hits every path alike), the minimum and the median per path.

--kernel picks the measurement; shapes are flags:
- gemv: the reference model's weight set in decode order (--layers x qkv, o, gate/up, down,
  then the LM head) at --rows rows: the C++ GEMV, F.linear (MKL) and oneDNN on packed weights,
  read as bandwidth (weight bytes / time) beside a buffer's read-only bandwidth;
- qgemm: the quantized projections (SmolLM2-135M's shapes, --types) at --rows rows: the
  integer kernel, the same kernel built untiled (--untiled), and dequantize + F.linear;
- attention: paged decode attention over --layers layers of scattered blocks, --cases
  SEQSxCONTEXT, --query-rows rows per sequence (1: decode; k + 1: a verification's rows): the
  C++ kernel against gather + torch SDPA;
- forward: one CausalLM.forward of the random-weight reference model (attention a no-op) at
  --tokens tokens, and the LM head, oneDNN-packed weights against F.linear;
- step: the engine's non-model work per decode step (Scheduler.schedule and
  update_from_output, a null model) at --running requests, and the step message's pickle;
- sampler: one sampler call on [--batch, vocab] logits, --fraction of the rows under a grammar
  bitmask against none (structured outputs' cost; --threads 1 on shared cores).

Before timing, every path's output is checked against a reference computed without it (torch's
F.linear, SDPA, gguf's dequantization), so a fast wrong kernel fails instead of winning. The
CPU and its SIMD flags head the output; --output-json writes the result.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from kvserve.bench import results
from kvserve.bench.timing import CheckError, _ints, check, interleaved  # noqa: F401

KERNELS = ("gemv", "qgemm", "attention", "forward", "step", "sampler")
# (out, in) per projection of bench-qwen2-small: q 512 + k 128 + v 128, o, gate/up, down
LAYER = [(768, 512), (512, 512), (2816, 512), (512, 1408)]
HEAD = (32000, 512)
# SmolLM2-135M: (label, out features, in features, gated)
QSHAPES = (("gate_up 576->2x1536", 3072, 576, True), ("down 1536->576", 576, 1536, False),
           ("qkv 576->960", 960, 576, False), ("o 576->576", 576, 576, False))


def add_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", choices=KERNELS, required=True)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per case (15)")
    p.add_argument("--rows", default="1,2,4,8", help="gemv, qgemm: input rows, comma list")
    p.add_argument("--layers", type=int, default=None,
                   help="gemv: weight layers (default 8); attention: cache layers (default 1)")
    p.add_argument("--types", default="Q4_1,Q8_0", help="qgemm: GGUF block types")
    p.add_argument("--untiled", action="store_true",
                   help="qgemm: also the kernel built with one x tile of any size")
    p.add_argument("--cases", default="64x200,1x200,8x4000,256x600",
                   help="attention: SEQSxCONTEXT, comma list")
    p.add_argument("--query-rows", default="1", help="attention: rows per sequence, comma list")
    p.add_argument("--heads", type=int, default=8, help="attention: query heads (8)")
    p.add_argument("--kv-heads", type=int, default=2, help="attention: KV heads (2)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--cold", action="store_true",
                   help="attention: evict the caches before each call (K/V from DRAM)")
    p.add_argument("--cxxflags", default="",
                   help="attention: build the kernel with these extra flags, e.g. "
                   "-march=x86-64-v3 or -DKVSERVE_SPLIT_TOKENS=256")
    p.add_argument("--arch", default="qwen2", help="forward: make-model architecture")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--tokens", default="64,8192", help="forward: tokens per forward")
    p.add_argument("--running", default="256,1024", help="step: running requests, comma list")
    p.add_argument("--steps", type=int, default=200, help="step: engine steps per case")
    p.add_argument("--batch", type=int, default=32, help="sampler: rows (32)")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="sampler: share of the rows under a bitmask (0.25)")
    results.add_result_args(p, "(no plot)")


# -- gemv ------------------------------------------------------------------------------------
def bench_gemv(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kvserve.kernels.cpu import gemv
    from kvserve.layers.cpu_linear import onednn_available, onednn_linear, onednn_pack

    g = gemv.load()
    if g is None:
        raise SystemExit("the C++ GEMV could not be built (no compiler?)")
    shapes = LAYER * (args.layers or 8) + [HEAD]
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, k, generator=gen) for o, k in shapes]
    nbytes = sum(w.numel() * 4 for w in ws)
    kernels = {"mkl": (lambda x, w: F.linear(x, w), ws), "gemv": (g.linear, ws)}
    if onednn_available(torch.float32, torch.device("cpu")):
        kernels["onednn"] = (lambda x, w: onednn_linear(x, w, None), [onednn_pack(w) for w in ws])
    buf = torch.ones(nbytes // 4)
    read = interleaved({"read": lambda: g.read_sum(buf)}, args.repeats)["read"]
    print(f"read-only bandwidth of a {nbytes / 1e6:.0f} MB buffer: "
          f"{nbytes / read['min_ms'] / 1e6:.1f} GB/s")
    rows_out = [{"case": {"read_only_buffer_mb": nbytes / 1e6}, "paths": {"read": read}}]
    for rows in _ints(args.rows):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        errs = {}
        for name, (fn, weights) in kernels.items():  # every shape against F.linear
            errs[name] = max(check(f"{name} {w.shape[0]}x{k} at {rows} rows", fn(xs[k], wt),
                                   F.linear(xs[k], w), atol=1e-3)
                             for (_, k), w, wt in zip(shapes, ws, weights))

        def whole(fn, weights):
            return lambda: [fn(xs[k], w) for (_, k), w in zip(shapes, weights)]

        with torch.inference_mode():
            timed = interleaved({n: whole(*kw) for n, kw in kernels.items()}, args.repeats)
        for t in timed.values():
            t["gb_s"] = nbytes / t["min_ms"] / 1e6
        print(f"{rows} rows: " + ", ".join(f"{n} {t['min_ms']:.2f} ms ({t['gb_s']:.1f} GB/s)"
                                           for n, t in timed.items()))
        rows_out.append({"case": {"rows": rows, "weight_mb": nbytes / 1e6}, "paths": timed,
                         "max_abs_err": errs})
    return rows_out


# -- qgemm -----------------------------------------------------------------------------------
def quant_weight(type_name: str, n: int, k: int, seed: int = 0):
    """Random [n, k] weights quantized by gguf-py, and their dequantization by gguf-py (the
    reference: not kvserve's own code)."""
    import gguf
    import numpy as np
    import torch
    from gguf import quants

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = np.ascontiguousarray(quants.quantize(w, qtype))
    ref = torch.from_numpy(np.asarray(quants.dequantize(raw, qtype), dtype=np.float32))
    data = torch.from_numpy(raw).view(torch.uint8).view(n, -1)
    return data, ref.reshape(n, k)


def bench_qgemm(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kvserve.kernels.cpu import cpu_ext, qgemv
    from kvserve.layers import quant_linear as ql

    kern = qgemv.load()
    if kern is None:
        raise SystemExit("no C++ compiler: the quantized kernel is not available")
    old = None
    if args.untiled:
        lib = cpu_ext.load_library(qgemv.SOURCE, cpu_ext.CXXFLAGS + (
            "-DKVQ_XTILE_MAX=1000000000", "-DKVQ_XTILE_BYTES=(1L<<50)"))
        old = None if lib is None else qgemv.QGemv(lib)
    print(f"kernel ISA {kern.isa}")
    out = []
    for type_name in args.types.split(","):
        for label, n, k, gated in QSHAPES:
            data, ref_w = quant_weight(type_name, n, k)
            w = ql.QuantWeight(data, type_name, k)
            mode = qgemv.MODE_SILU_MUL if gated else qgemv.MODE_STORE
            deq = (ql.QuantizedGated(w, None, n // 2, False, int_rows=0) if gated
                   else ql.QuantizedLinear(w, None, int_rows=0))
            for rows in _ints(args.rows):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                want = F.linear(x, ref_w)
                if gated:
                    want = F.silu(want[:, :n // 2]) * want[:, n // 2:]
                bound = {"tiled": kern.bind(data, type_name, k, None, mode)}
                if old is not None:
                    bound["untiled"] = old.bind(data, type_name, k, None, mode)
                paths = {p: (lambda b=b: b(x)) for p, b in bound.items()}
                paths["dequant"] = lambda: deq.apply(x)
                # the kernels quantize x to 8 bits: the tolerance is the int8 rounding's
                errs = {p: check(f"{type_name} {label} {p} at {rows} rows", f(), want,
                                 atol=0.02 * float(want.abs().max()) + 1e-3, rtol=0.02)
                        for p, f in paths.items()}
                timed = interleaved(paths, args.repeats, min_sample_s=0.02)
                print(f"{type_name} {label} rows {rows:4d}: " + "  ".join(
                    f"{p} {1e3 * t['median_ms']:.1f} us" for p, t in timed.items()))
                out.append({"case": {"type": type_name, "shape": label, "rows": rows},
                            "paths": timed, "max_abs_err": errs})
    return out


def main_kernel(args: argparse.Namespace) -> Callable[[argparse.Namespace], list[dict]]:
    """The function that measures --kernel."""
    if args.kernel in ("attention", "forward", "step", "sampler"):
        from kvserve.bench import kernel_cases

        return getattr(kernel_cases, f"bench_{args.kernel}")
    return {"gemv": bench_gemv, "qgemm": bench_qgemm}[args.kernel]


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvserve.kernels.cpu.cpu_features import cpu_info

    torch.set_num_threads(args.threads)
    cpu = cpu_info().flags_line()
    print(f"{cpu}\n{args.kernel}: {args.threads} thread(s), {args.repeats} rounds, load "
          f"average {os.getloadavg()[0]:.1f}; ms are min and median of the rounds")
    cases = main_kernel(args)(args)
    out = {"kernel": args.kernel, "cpu": cpu, "threads": args.threads,
           "repeats": args.repeats, "cases": cases}
    results.finish(args, out, "kernels")
    return out
