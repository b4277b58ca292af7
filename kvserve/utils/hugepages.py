"""Back the big CPU tensors (the weights, their packed copies, the KV pool) with 2 MiB pages.

Why: a CPU decode step streams every weight once per token (156 MB for the reference model)
and, at batch 64, ~100 MB of K/V scattered over cache blocks. On 4 KiB pages that is one
page walk per 4 KiB read; the hardware prefetchers also stop at 4 KiB boundaries. Where the
kernel hands out transparent huge pages only on request (`enabled` = madvise, the common
default), torch's allocations never get them. Measured on this project's 2-vCPU Xeon: batch-1
decode 4.74 -> 4.37 ms per token, batch-64 decode attention ~7% faster (issue 18's
third pass: `git show 9b55a61:docs/benchmarks.md`).

`empty` gives such memory: a private anonymous mapping of the tensor's own, 2 MiB aligned,
asked for huge pages (MADV_HUGEPAGE) before anything touches it, so each first touch faults in
a zeroed huge page and only the pages written are ever resident. Why not `torch.empty` and an
madvise afterwards, as before: torch's memory is often pages the allocator had faulted in
already, which only MADV_COLLAPSE (Linux >= 6.1) re-backs, and that, with a /proc/self/maps
read per tensor, cost 0.6 s of a 5 s start. Off with KVSERVE_HUGE_PAGES=0 (the mappings stay,
on 4 KiB pages); no huge pages off Linux or with THP `never`. oneDNN's packed weights are
opaque (their memory is oneDNN's) and stay on 4 KiB pages, as do tensors under 256 KiB.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
from pathlib import Path

import torch

HUGE = 2 << 20
# Smaller tensors (norms, biases) get torch's own memory: a mapping of their own would spend a
# 2 MiB page on a few KB.
MIN_BYTES = 256 << 10
MADV_HUGEPAGE = 14
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux") or os.environ.get("KVSERVE_HUGE_PAGES", "1") == "0":
        return None
    try:
        if "[never]" in THP_ENABLED.read_text():
            return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on memory never used before, which reads as zeros until written (see the
    module docstring): on 2 MiB pages where the kernel gives them, and only the pages written
    are ever faulted in. Small tensors (under MIN_BYTES) and systems without anonymous
    mappings get `torch.zeros`."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    if nbytes > CHUNK // 2:
        memory, offset = _mapping(nbytes)
    else:
        memory, offset = _ARENA.take(nbytes)
    # the tensor keeps its mapping alive (frombuffer holds the buffer)
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(shape)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh private anonymous mapping with whole, advised huge pages for `nbytes` from the
    returned offset on."""
    span = -(-nbytes // HUGE) * HUGE
    # One huge page more than the span, so that a 2 MiB-aligned start lies inside; the slack is
    # address space only (never touched, never resident).
    memory = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE
    madvise = _madvise()
    if madvise is not None:
        madvise(base + offset, span, MADV_HUGEPAGE)  # refused (no huge pages): 4 KiB pages
    return memory, offset


class _Arena:
    """Tensors up to half a CHUNK are cut one after another from shared mappings (a bump
    allocator; nothing is reused, so the memory is still zero). Why not a mapping each: a
    written huge page is resident whole, and SmolLM2's 1-7 MB weights, each rounded up to 2 MiB
    pages, took 270 MB more memory than on 4 KiB pages. A mapping lives as long as the last
    tensor cut from it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: mmap.mmap | None = None
        self._next = self._end = 0

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        with self._lock:
            start = -(-self._next // ALIGN) * ALIGN
            if self._memory is None or start + nbytes > self._end:
                self._memory, start = _mapping(CHUNK)
                self._end = start + CHUNK
            self._next = start + nbytes
            return self._memory, start


ALIGN = 64  # bytes: a cache line, and whole AVX-512 vectors
CHUNK = 64 << 20
_ARENA = _Arena()
