#!/usr/bin/env python
"""Small-batch GEMMs on the reference model's shapes: kvserve's C++ GEMV vs F.linear (MKL) vs
oneDNN with packed weights, side by side in one process, at 1, 2, 4 and 8 rows.

Why: which kernel wins at batch 1 depends on the CPU (gemm_select.py measures it at load); this
shows by how much, and up to which row count the GEMV (which re-reads each weight block from
L1 per extra row) stays ahead, to set gemv.MAX_ROWS. Each figure is the minimum over
--samples interleaved timings of the model's whole weight set run in decode order (8 layers x
qkv, o, gate/up, down, then the LM head: 156 MB, L3-resident or not as the CPU allows), so it
reads as bandwidth: GB/s = weight bytes / time. The read-only bandwidth of a buffer of the same
size is the ceiling any of them can reach.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_gemv.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import gemv
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.layers.cpu_linear import onednn_available
from kvserve.layers.cpu_linear import onednn_linear as _onednn_linear
from kvserve.layers.cpu_linear import onednn_pack as _onednn_pack

# (out, in) per projection of bench-qwen2-small (hidden 512, intermediate 1408, 8 layers,
# vocab 32000; q 512 + k 128 + v 128 rows)
LAYER = [(768, 512), (512, 512), (2816, 512), (512, 1408)]
HEAD = (32000, 512)


def best(fn, samples: int) -> float:
    fn()
    m = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        m = min(m, time.perf_counter() - t0)
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--rows", default="1,2,4,8")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = gemv.load()
    if g is None:
        raise SystemExit("the C++ GEMV could not be built (no compiler?)")
    shapes = LAYER * args.layers + [HEAD]
    ws = [torch.randn(o, k) for o, k in shapes]
    nbytes = sum(w.numel() * 4 for w in ws)
    kernels = {"mkl": (lambda x, w: F.linear(x, w), ws), "gemv": (g.linear, ws)}
    if onednn_available(torch.float32, torch.device("cpu")):
        kernels["onednn"] = (lambda x, w: _onednn_linear(x, w, None),
                             [_onednn_pack(w) for w in ws])
    buf = torch.ones(nbytes // 4)
    print(f"cpu: {cpu_info().summary()}; {torch.get_num_threads()} threads; load average "
          f"{os.getloadavg()[0]:.1f}")
    read = best(lambda: g.read_sum(buf), args.samples)
    print(f"read-only bandwidth of a {nbytes / 1e6:.0f} MB buffer: {nbytes / read / 1e9:.1f} "
          f"GB/s ({read * 1e3:.2f} ms)")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
            times = {}
            for name, (fn, weights) in kernels.items():
                def run(fn=fn, weights=weights, xs=xs):
                    for (_, k), w in zip(shapes, weights):
                        fn(xs[k], w)
                times[name] = best(run, args.samples)
            cells = ", ".join(f"{k} {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s)"
                              for k, t in times.items())
            print(f"{rows} rows: {cells}; gemv / mkl time {times['gemv'] / times['mkl']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
