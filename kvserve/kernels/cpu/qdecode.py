"""The one-call decode step on quantized weights (csrc/qdecode.cpp): every decoder layer of a
decode step of a few rows in one C++ call, the projections on qgemv's kernel and attention on
the paged decode kernel. kvserve/layers/quant_decode.py prepares its arguments."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from kvserve.kernels.cpu import cpu_ext

SOURCE = Path(__file__).with_name("csrc") / "qdecode.cpp"
ABI_VERSION = 2


class QDecode:
    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.kvserve_qdecode_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{lib._name} has a different ABI version")
        fn = lib.kvserve_qdecode_layers
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self.decode_layers = fn


@functools.lru_cache(maxsize=1)
def load() -> QDecode | None:
    """The kernel, built on first call; None (logged once by cpu_ext) where it cannot be."""
    return cpu_ext.load_kernel(SOURCE, QDecode, "quantized decode runs layer by layer")
