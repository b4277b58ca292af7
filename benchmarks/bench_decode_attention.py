#!/usr/bin/env python
"""Decode attention for one layer: the paged kernel (kvserve/attention/cpu_paged.py)
against the gather + SDPA path it replaces, through TorchAttentionBackend, same inputs.

Each figure is the minimum over --repeats calls of bind (the per-step prepare) + one layer's
forward: on a shared machine the minimum is the sample other processes disturbed least.
Reference-model shapes by default (8 query heads, 2 KV heads, head dim 64, block 16), blocks
scattered over the cache as a running engine's are. With --cold every call first reads a
buffer of twice the L3 size, so the K/V comes from DRAM as in an engine step (where the
weights and the other layers' K/V pass through the cache between two reads of a layer);
without it the K/V of a case may sit in cache.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_decode_attention.py --threads 1
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_decode_attention.py --threads 2 --cold
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_decode_attention.py --threads 2 --march x86-64-v3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvserve.kv.spec import KVStorage, decoder_kv_spec  # noqa: E402
from kvserve.kv.tensors import KVTensorPool  # noqa: E402
from kvserve.kernels.cpu import cpu_ext  # noqa: E402
from kvserve.attention import cpu_paged  # noqa: E402
from kvserve.attention.base import AttentionMetadata, SequenceSlice  # noqa: E402
from kvserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.kernels.cpu.cpu_features import cpu_info, l3_cache_bytes  # noqa: E402
from kvserve.layers.gemm_select import cache_evictor  # noqa: E402


def one(n: int, ctx: int, heads: int, kv_heads: int, dim: int, bs: int, repeats: int,
        evict: Callable[[], object] | None,
        kernel: cpu_paged.PagedDecodeKernel | None = None) -> dict:
    per = -(-(ctx + 1) // bs)
    k = torch.randn(n * per + 1, bs, kv_heads, dim)
    v = torch.randn_like(k)
    order = torch.randperm(n * per, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * per:(i + 1) * per] for i in range(n)]
    decodes = [SequenceSlice(i, 1, ctx, tables[i]) for i in range(n)]
    slots = [tables[i][(ctx - 1) // bs] * bs + (ctx - 1) % bs for i in range(n)]
    meta = AttentionMetadata(torch.tensor(slots), [], decodes, 0)
    q, nk, nv = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    spec = decoder_kv_spec(1, kv_heads, dim, KVStorage("fp32"), bs)
    out = {}
    for mode in ("kernel", "gather"):
        backend = TorchAttentionBackend(KVTensorPool.wrap(spec, [(k, v)]), dim ** -0.5)
        if mode == "gather":
            backend.paged_kernel = None
        elif kernel is not None:
            backend.paged_kernel = kernel
        elif backend.paged_kernel is None:
            out[mode] = float("nan")
            continue
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                if evict is not None:
                    evict()
                t0 = time.perf_counter()
                backend.bind(meta)(0, q, nk, nv)
                best = min(best, time.perf_counter() - t0)
        out[mode] = best
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--cases", default="64x200,1x200,8x4000,256x600",
                   help="decodes x context, ...")
    p.add_argument("--cold", action="store_true",
                   help="evict the caches before each call (K/V from DRAM)")
    p.add_argument("--march", help="build the kernel for this -march (e.g. x86-64-v3: AVX2 "
                   "code on a CPU with AVX-512) instead of native")
    args = p.parse_args()
    kernel = None
    if args.march:
        flags = tuple(f"-march={args.march}" if f.startswith("-march") else f
                      for f in cpu_ext.CXXFLAGS)
        lib = cpu_ext.load_library(cpu_paged.SOURCE, flags)
        if lib is None:
            p.error(f"the kernel does not build with -march={args.march}")
        kernel = cpu_paged.PagedDecodeKernel(lib)
    torch.set_num_threads(args.threads)
    l3 = l3_cache_bytes()
    evict = cache_evictor(2 * l3 if l3 else None) if args.cold else None
    print(f"cpu: {cpu_info().summary()}; {args.threads} thread(s); load average "
          f"{os.getloadavg()[0]:.1f}; K/V {'from DRAM (--cold)' if args.cold else 'maybe cached'}; "
          f"kernel built for -march={args.march or 'native'}")
    print(f"{'decodes x ctx':>14} {'kernel':>10} {'gather':>10} {'speed-up':>9}")
    for case in args.cases.split(","):
        n, ctx = (int(x) for x in case.split("x"))
        r = one(n, ctx, 8, 2, 64, 16, args.repeats, evict, kernel)
        print(f"{case:>14} {r['kernel'] * 1e3:>8.2f}ms {r['gather'] * 1e3:>8.2f}ms "
              f"{r['gather'] / r['kernel']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
