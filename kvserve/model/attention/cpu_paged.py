"""Decode attention that reads the paged KV cache in place, on the CPU (csrc/paged_decode.cpp).

Why: the torch backend's decode path gathers every running sequence's whole K/V into a scratch
tensor each layer of each step and then runs SDPA over it with a length mask: the gather alone
was 16% of a batch-64 decode step. This kernel walks each sequence's block table instead, with
an online softmax, so every cached K/V byte is read once and nothing is written but the output.

The kernel is plain C++ with a C ABI, compiled at first use with the machine's compiler
(`$CXX`, else `c++`/`g++`; -O3 -march=native -fopenmp) into `$KVSERVE_CACHE_DIR/ext/`, one
library per source, flags, compiler and CPU, and loaded with ctypes. Not a torch extension:
without torch's headers it builds in about a second instead of a minute, and it needs nothing
from torch but data pointers. Its OpenMP calls resolve to the libgomp torch has already loaded,
so it runs on torch's threads. Where there is no compiler (or the build fails) `load_kernel`
returns None, logs why once, and the backend keeps its gather path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvserve.model.cpu_features import cpu_info

logger = logging.getLogger("kvserve")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ABI_VERSION = 1
# Limits of the kernel's fixed per-thread buffers (see the .cpp file).
MAX_GROUP = 64
MAX_GROUP_DIM = 16384
MAX_BLOCK_SIZE = 256
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_root() -> Path:
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "kvserve") / "ext"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build_key(cxx: str) -> str:
    """Source + flags + compiler version + CPU: -march=native code is only valid on the CPU it
    was built for, so a cache directory shared between machines keeps one build per CPU."""
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                             text=True, timeout=30).stdout.splitlines()[:1]
    info = cpu_info()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXXFLAGS).encode(), repr(version).encode(),
                 info.model_name.encode(), " ".join(sorted(info.flags)).encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_library() -> Path:
    """Compile the kernel once (atomic rename into the cache, so concurrent first uses are
    safe) and return the shared library's path; RuntimeError when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    out = _cache_root() / f"paged_decode-{_build_key(cxx)}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *CXXFLAGS, str(SOURCE), "-o", tmp], check=False,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one layer's decode attention for a batch."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
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
    try:
        kernel = PagedDecodeKernel(build_library())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("paged decode kernel unavailable, decode attention gathers K/V "
                       "instead: %s", e)
        return None
    logger.debug("paged decode kernel: %s", kernel.path)
    return kernel

