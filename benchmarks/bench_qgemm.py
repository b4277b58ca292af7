"""The quantized projections at 1-512 rows (issue 31): the tiled integer kernel
(kernels/cpu/csrc/qgemv.cpp), the same kernel untiled (built with one x tile of any size:
the loop before the tiles), and the weight dequantized into the shared scratch + F.linear
(MKL), each as quant_linear's methods run them (the gated one with SiLU * up), on SmolLM2-135M's
shapes, Q4_1 (the default model's) and Q8_0, random weights.

    PYTHONPATH=. python benchmarks/bench_qgemm.py [--threads 2] [--types Q4_1,Q8_0]

Prints the CPU, then per shape and row count the median of `--repeats` timings per path
(the paths interleaved, each timing the mean of enough calls to fill ~20 ms) and the
crossover quant_linear would measure (`crossover_rows`). Timings on a shared machine are
noisy: read the medians, compare paths within one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvserve.kernels.cpu import cpu_ext, qgemv  # noqa: E402
from kvserve.kernels.cpu.cpu_features import cpu_info  # noqa: E402
from kvserve.layers import quant_linear as ql  # noqa: E402

# SmolLM2-135M: (label, out features, in features, gated)
SHAPES = (("gate_up 576->2x1536", 3072, 576, True), ("down 1536->576", 576, 1536, False),
          ("qkv 576->960", 960, 576, False), ("o 576->576", 576, 576, False))
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def blocks(type_name: str, n: int, k: int, seed: int = 0) -> ql.QuantWeight:
    import gguf
    from gguf import quants

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name))
    data = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).view(n, -1)
    return ql.QuantWeight(data, type_name, k)


def timed(fn, target_s: float = 0.02) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    calls = max(1, min(200, int(target_s / max(one, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def untiled_kernel() -> qgemv.QGemv | None:
    flags = cpu_ext.CXXFLAGS + ("-DKVQ_XTILE_MAX=1000000000", "-DKVQ_XTILE_BYTES=(1L<<50)")
    lib = cpu_ext.load_library(qgemv.SOURCE, flags)
    return None if lib is None else qgemv.QGemv(lib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_1,Q8_0")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-untiled", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = qgemv.load()
    if kern is None:
        sys.exit("no C++ compiler: the quantized kernel is not available")
    print(f"CPU: {cpu_info().summary()}")
    print(f"flags: {' '.join(sorted(f for f in cpu_info().flags if f.startswith(('avx', 'fma', 'f16c', 'amx'))))}")
    print(f"kernel ISA {kern.isa}, {args.threads} threads, torch {torch.__version__}")
    old = None if args.no_untiled else untiled_kernel()
    rows_list = [int(r) for r in args.rows.split(",")]
    for type_name in args.types.split(","):
        for label, n, k, gated in SHAPES:
            w = blocks(type_name, n, k)
            print(f"\n{type_name} {label}: us per call (median of {args.repeats}); "
                  "tiled / untiled / dequant+MKL")
            for rows in rows_list:
                x = torch.randn(rows, k)
                if gated:
                    mode = qgemv.MODE_SILU_MUL
                    deq = ql.QuantizedGated(w, None, n // 2, False, int_rows=0)
                else:
                    mode = qgemv.MODE_STORE
                    deq = ql.QuantizedLinear(w, None, int_rows=0)
                paths = {"tiled": kern.bind(w.data, type_name, k, None, mode),
                         "dequant": lambda d=deq, x=x: d.apply(x)}
                if old is not None:
                    paths["untiled"] = old.bind(w.data, type_name, k, None, mode)
                ts: dict[str, list[float]] = {p: [] for p in paths}
                for r in range(args.repeats):
                    for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                        f = paths[p]
                        ts[p].append(timed(f if p == "dequant" else (lambda f=f: f(x))))
                med = {p: statistics.median(v) * 1e6 for p, v in ts.items()}
                best = min(med, key=med.get)
                print(f"  rows {rows:4d}: tiled {med['tiled']:9.1f}"
                      + (f"  untiled {med['untiled']:9.1f}" if "untiled" in med else "")
                      + f"  dequant {med['dequant']:9.1f}   best {best}"
                      + f"  (dequant/tiled {med['dequant'] / med['tiled']:.2f})")


if __name__ == "__main__":
    main()
