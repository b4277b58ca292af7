"""Compile a plain C++ source into a cached shared library and load it with ctypes.

Why: the CPU kernels (the paged decode attention, `csrc/paged_decode.cpp`; the
small-batch GEMV, `csrc/gemv.cpp`) are C++ with a C ABI, built at first use with the machine's
compiler (`$CXX`, else `c++`/`g++`/`clang++`) and -march=native (or the cap of
$KVSERVE_CPU_ISA, cpu_features.march). Not torch extensions: without
torch's headers a source builds in about a second instead of a minute, and a kernel needs
nothing from torch but data pointers. Their OpenMP calls resolve to the libgomp torch has
already loaded, so they run on torch's threads.

A library is kept in `$KVSERVE_CACHE_DIR/ext/` (default ~/.cache/kvserve/ext), one per source,
flags, compiler version and CPU: -march=native code is only valid on the CPU it was built for,
so a cache directory shared between machines keeps one build per CPU. Builds are written to a
temporary file and renamed into place, so concurrent first uses are safe. `load_library`
returns None (and logs why, once per source) where there is no compiler or the build fails:
every caller keeps a pure-PyTorch path, and `load_kernel` gives each kernel's binding the same
rule.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvserve.kernels.cpu.cpu_features import cpu_info, march
from kvserve.utils.paths import cache_dir

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvserve")
K = TypeVar("K")

CXXFLAGS = ("-O3", f"-march={march()}", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def cache_root() -> Path:
    return cache_dir() / "ext"


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of c++, g++, clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def local_includes(source: Path) -> list[Path]:
    """The files `source` includes with quotes (#include "..."), relative to it, recursively:
    they are part of what a build compiles, so of its key."""
    found: list[Path] = []
    todo = [source]
    while todo:
        current = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', current.read_text(),
                               flags=re.MULTILINE):
            path = (current.parent / name).resolve()
            if path.is_file() and path not in found:  # else a system header's quoted name
                found.append(path)
                todo.append(path)
    return found


def build_key(source: Path, flags: tuple[str, ...], cxx: str) -> str:
    """Hash of source (and its local includes) + flags + compiler version + CPU model and
    flags + architecture."""
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                             text=True, timeout=30).stdout.splitlines()[:1]
    info = cpu_info()
    h = hashlib.sha256()
    for part in (source.read_bytes(), *(p.read_bytes() for p in local_includes(source)),
                 " ".join(flags).encode(), repr(version).encode(),
                 info.model_name.encode(), " ".join(sorted(info.flags)).encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(source: Path, flags: tuple[str, ...] = CXXFLAGS) -> Path:
    """Compile `source` once into the cache and return the library's path; RuntimeError when
    it cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    out = cache_root() / f"{source.stem}-{build_key(source, flags, cxx)}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], check=False,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_library(source: Path, flags: tuple[str, ...] = CXXFLAGS) -> ctypes.CDLL | None:
    """The built and loaded library of `source` (cached per process), or None with a warning
    logged once when it cannot be built or loaded."""
    try:
        path = build(source, flags)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("C++ kernel %s unavailable (PyTorch path instead): %s", source.name, e)
        return None
    logger.debug("C++ kernel %s: %s", source.name, path)
    _share_pool(lib)
    return lib


_POOL_OWNER: list[ctypes.CDLL] = []  # the library whose thread pool every library runs on


def _share_pool(lib: ctypes.CDLL) -> None:
    """One worker pool per process (csrc/parallel.h): the first library with a pool keeps
    its own, each later one is handed the first's `kvserve_pool_run`."""
    if not hasattr(lib, "kvserve_pool_share"):
        return
    if not _POOL_OWNER:
        _POOL_OWNER.append(lib)
        return
    share = lib.kvserve_pool_share
    share.argtypes, share.restype = [ctypes.c_void_p], None
    share(ctypes.cast(_POOL_OWNER[0].kvserve_pool_run, ctypes.c_void_p))


def load_kernel(source: Path, wrap: Callable[[ctypes.CDLL], K], instead: str) -> K | None:
    """`wrap` (a kernel's ctypes binding) over the library of `source`, or None where it cannot
    be built or `wrap` refuses it (RuntimeError: a library of another ABI version), logged
    with what the caller does `instead`. One rule for every kernel: a missing kernel is a
    slower path, never an error."""
    lib = load_library(source)
    if lib is None:
        return None
    try:
        return wrap(lib)
    except RuntimeError as e:
        logger.warning("C++ kernel %s unavailable (%s): %s", source.name, instead, e)
        return None


def address(t: torch.Tensor | None) -> int:
    """A tensor's data address as a C pointer argument; 0 (NULL) for an optional one left out."""
    return 0 if t is None else t.data_ptr()
