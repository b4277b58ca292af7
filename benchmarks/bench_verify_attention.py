#!/usr/bin/env python
"""The paged decode kernel alone at batch 1 in a model's shape: one row, and a speculative
verification's rows (consecutive positions of one sequence, one block table) at long contexts.

Each figure is one step's attention over every layer (each layer its own K/V cache, blocks
scattered over it as a running engine's are, so at a few thousand tokens the K/V comes from
DRAM as in an engine step): the median of --passes passes after two warm-up ones. Default
shape SmolLM2-135M's (30 layers, 9 query heads, 3 KV heads, head_dim 64, block 16): its three
KV-head work items are what issue 49's split-K spreads over the threads.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_verify_attention.py --threads 2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_verify_attention.py --kv-heads 8 \\
        --heads 32 --layers 16 --contexts 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvserve.attention import cpu_paged
from kvserve.kernels.cpu import cpu_ext
from kvserve.kernels.cpu.cpu_features import cpu_info

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_ms(kernel: cpu_paged.PagedDecodeKernel, ctx: int, rows: int, args: argparse.Namespace
            ) -> float:
    bs, dim = 16, args.head_dim
    per = -(-(ctx + rows) // bs)
    gen = torch.Generator().manual_seed(ctx)
    caches = []
    for _ in range(args.layers):
        k = torch.randn(per + 1, bs, args.kv_heads, dim, generator=gen).to(DTYPES[args.dtype])
        caches.append(cpu_paged.PagedKV(cpu_paged.FLOAT_KINDS[k.dtype], k, torch.randn_like(k
                                        .float()).to(k.dtype), dim))
    table = torch.randperm(per, generator=gen).unsqueeze(0).repeat(rows, 1)
    lens = torch.arange(ctx, ctx + rows, dtype=torch.int64)  # row r sees the rows before it
    q = torch.randn(rows, args.heads, dim, generator=gen)
    out = torch.empty_like(q)
    step = kernel.step(table.contiguous(), lens)
    times = []
    for i in range(args.passes + 2):
        t0 = time.perf_counter()
        for kv in caches:
            step.run(q, kv, dim ** -0.5, out)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--contexts", default="1000,2800,4000")
    p.add_argument("--rows", default="1,5", help="rows per step (verification: k + 1)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--split-tokens", type=int,
                   help="build the kernel with this split-K part size (KVSERVE_SPLIT_TOKENS)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.split_tokens:
        lib = cpu_ext.load_library(cpu_paged.SOURCE, cpu_ext.CXXFLAGS + (
            f"-DKVSERVE_SPLIT_TOKENS={args.split_tokens}",))
        kernel = cpu_paged.PagedDecodeKernel(lib) if lib is not None else None
    else:
        kernel = cpu_paged.load_kernel()
    if kernel is None:
        p.error("the paged decode kernel does not build here")
    print(f"{cpu_info().flags_line()}; {args.threads} thread(s); load average "
          f"{os.getloadavg()[0]:.1f}; kernel {kernel.path.name}")
    print(f"{args.layers} layers x {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
          f"{args.dtype} K/V, ms per step (median of {args.passes})")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'context':>8}" + "".join(f"{f'{r} row(s)':>12}" for r in rows)
          + ("   ratio" if len(rows) > 1 else ""))
    for ctx in (int(c) for c in args.contexts.split(",")):
        ms = [step_ms(kernel, ctx, r, args) for r in rows]
        print(f"{ctx:>8}" + "".join(f"{m:>10.2f}ms" for m in ms)
              + (f"   {ms[-1] / ms[0]:.2f}x" if len(rows) > 1 else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
