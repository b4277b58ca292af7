"""Decode attention that reads the paged KV cache in place, on the CPU (csrc/paged_decode.cpp).

Why: the torch backend's decode path gathers every running sequence's whole K/V into a scratch
tensor each layer of each step and then runs SDPA over it with a length mask: the gather alone
was 16% of a batch-64 decode step. This kernel walks each sequence's block table instead, with
an online softmax, so every cached K/V byte is read once and nothing is written but the output.

The kernel is plain C++ with a C ABI, compiled at first use with the machine's compiler and
loaded with ctypes (`kvserve.model.cpu_ext`: cached per source, flags, compiler and CPU; runs
on torch's OpenMP threads). Where there is no compiler (or the build fails) `load_kernel`
returns None, logs why once, and the backend keeps its gather path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from kvserve.model import cpu_ext

logger = logging.getLogger("kvserve")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
ABI_VERSION = 1
# Limits of the kernel's fixed per-thread buffers (see the .cpp file).
MAX_GROUP = 64
MAX_GROUP_DIM = 16384
MAX_BLOCK_SIZE = 256
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one layer's decode attention for a batch."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        path = Path(lib._name)
        if lib.kvserve_paged_decode_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} has a different ABI version")
        fn = lib.kvserve_paged_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64,
                       i64, i64, ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib  # keeps the library loaded
        self.path = path

    @staticmethod
    def supports(k_cache: torch.Tensor) -> bool:
        """Whether a cache of this dtype and shape ([blocks, block_size, Hkv, D]) fits the
        kernel: unquantized float32 / bfloat16, contiguous, on the CPU, block size and head
        dim within its buffers. (A query-head group above MAX_GROUP, which no released model
        has, is refused with a ValueError at the call.)"""
        if k_cache.device.type != "cpu" or k_cache.dtype not in KV_DTYPES:
            return False
        if not k_cache.is_contiguous() or k_cache.dim() != 4:
            return False
        _, block_size, hkv, d = k_cache.shape
        return hkv > 0 and block_size <= MAX_BLOCK_SIZE and d <= MAX_GROUP_DIM

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """q [n, H, D] float32 (token rows may be strided; heads and D contiguous), caches
        [blocks, block_size, Hkv, D], tables [n, max_blocks] int64, lens [n] int64 ->
        [n, H, D] float32 (into `out` when given: contiguous, float32)."""
        n, h, d = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
            q = q.float().contiguous()
        if out is None:
            out = torch.empty((n, h, d), dtype=torch.float32)
        _, block_size, hkv, _ = k_cache.shape
        rc = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                      KV_DTYPES[k_cache.dtype], tables.data_ptr(), tables.stride(0),
                      lens.data_ptr(), out.data_ptr(), n, h, hkv, d, block_size, scale)
        if rc != 0:
            raise ValueError(f"paged decode kernel: unsupported shape H={h} Hkv={hkv} D={d} "
                             f"block_size={block_size}")
        return out


def decode_tables(decodes: list, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [n, max_blocks] (int64, zero-padded) and lengths [n] for a step's decodes
    (`SequenceSlice`s), built with one tensor call each."""
    lens = [s.seq_len for s in decodes]
    width = -(-max(lens) // block_size)
    rows = [s.block_table[:width] for s in decodes]
    rows = [r if len(r) == width else r + [0] * (width - len(r)) for r in rows]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


@functools.lru_cache(maxsize=1)
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built on first call; None (logged once) where it cannot be built or the
    environment sets KVSERVE_CPU_PAGED_DECODE=0."""
    if os.environ.get("KVSERVE_CPU_PAGED_DECODE", "1") == "0":
        logger.info("paged decode kernel off (KVSERVE_CPU_PAGED_DECODE=0): gather path")
        return None
    lib = cpu_ext.load_library(SOURCE)
    if lib is None:
        logger.warning("paged decode kernel unavailable: decode attention gathers K/V instead")
        return None
    try:
        kernel = PagedDecodeKernel(lib)
    except RuntimeError as e:
        logger.warning("paged decode kernel unavailable, decode attention gathers K/V "
                       "instead: %s", e)
        return None
    logger.debug("paged decode kernel: %s", kernel.path)
    return kernel

