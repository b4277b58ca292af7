"""Products on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept
as the file stores them (csrc/qgemv.cpp): the quantized linear layers' kernel.

Why: batch-1 decode reads every weight once per step; Q4_1 is 20 bytes per 32 weights where
the fp32 copy kvserve dequantized at load is 128. `linear` quantizes the rows of x to 8-bit
blocks and runs integer dot products on the weight blocks (AVX2 maddubs, or VNNI dpbusd
where the build has it); `dequantize` writes the float32 weight (the prefill path runs a
GEMM on it); `embed` the rows of a quantized embedding table that a batch looks up. A
weight is a uint8 tensor [n, k / values per block * block bytes], row after row of blocks
(32 values a block, 256 for the K-quants, which llama.cpp's Q4_K_M files hold: there a
row's k must be a multiple of 256).
Past a few rows the kernel runs in cache tiles (16 output features x up to 64 rows of x), so
it also serves prefill-sized calls (quant_linear measures where it beats the dequantized GEMM).
Its threads (torch's thread count) claim units of work from the kernel's own pool
(csrc/parallel.h) instead of OpenMP's fork/join, which waited for a descheduled thread beside
other busy processes; KVSERVE_CPU_POOL=omp runs it on OpenMP (comparisons).
Where no compiler is found `load()` returns None and quantized weights are dequantized at
load instead.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvserve.kernels.cpu import cpu_ext

SOURCE = Path(__file__).with_name("csrc") / "qgemv.cpp"
ABI_VERSION = 9
TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "Q5_0": 5,
         "Q5_1": 6, "Q5_K": 7}  # the kernel's type codes
BLOCK = 32  # values per block of x (and of the 32-value weight types)
BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256, "Q5_0": 32,
                "Q5_1": 32, "Q5_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210, "Q5_0": 22,
               "Q5_1": 24, "Q5_K": 176}
TILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # with row tiles
TILE_ROWS = 16  # output features per tile
TILED_CODE = 8  # a tiled weight's kernel type code: its block type's + 8
MODE_STORE, MODE_ADD, MODE_SILU_MUL, MODE_GELU_MUL = 0, 1, 2, 3
ISA_NAMES = {0: "C++", 1: "AVX2", 2: "VNNI"}


def row_bytes(type_name: str, k: int) -> int:
    return k // BLOCK_VALUES[type_name] * BLOCK_BYTES[type_name]


def fits(type_name: str, k: int) -> bool:
    """Whether the kernel runs a `type_name` weight with rows of k values."""
    return type_name in TYPES and k > 0 and k % BLOCK_VALUES[type_name] == 0


def tileable(type_name: str, n: int, k: int) -> bool:
    """Whether an n x k weight of this type can be held in row tiles (csrc/qtiles.h,
    csrc/qtiles_k.h)."""
    return type_name in TILE_TYPES and n % TILE_ROWS == 0 and fits(type_name, k)


def type_code(type_name: str, tiled: bool = False) -> int:
    return TYPES[type_name] + (TILED_CODE if tiled else 0)


class QGemv:
    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.kvserve_qgemv_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{lib._name} has a different ABI version")
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.kvserve_qgemv
        fn.argtypes = [ptr, i64, i64, ptr, c_int, i64, i64, ptr, ptr, i64, c_int, c_int]
        fn.restype = c_int
        deq = lib.kvserve_qdequant
        deq.argtypes = [ptr, c_int, i64, i64, ptr, c_int]
        deq.restype = c_int
        fx = lib.kvserve_qgemv_f32x
        fx.argtypes = fn.argtypes
        fx.restype = c_int
        packed = lib.kvserve_qgemv_packed
        packed.argtypes = [ptr]
        packed.restype = c_int
        emb = lib.kvserve_qembed
        emb.argtypes = [ptr, c_int, i64, i64, ptr, i64, ptr, c_int]
        emb.restype = c_int
        self._fn, self._deq, self._fx, self._packed = fn, deq, fx, packed
        self._embed = emb
        pack = lib.kvserve_qtile_pack
        pack.argtypes = [ptr, c_int, i64, i64, ptr, c_int]
        pack.restype = c_int
        self._pack = pack
        self.tiles_native = bool(lib.kvserve_qtile_native())
        self._tile_types = int(lib.kvserve_qtile_types())
        self.isa = ISA_NAMES[lib.kvserve_qgemv_isa()]
        self._lib = lib

    def tiles_pay(self, type_name: str) -> bool:
        """Whether this build runs `type_name`'s row tiles faster than the file's rows (the
        VNNI tile kernel: every tile type; the AVX2 one: every type but Q8_0, whose table is
        also the LM head's; kvserve_qtile_types has the measurements), so that the
        loader holds such weights as tiles."""
        return type_name in TYPES and bool(self._tile_types >> TYPES[type_name] & 1)

    @staticmethod
    def check_weight(w: torch.Tensor, type_name: str, n_w: int, k: int,
                     tiled: bool = False) -> None:
        if type_name not in TYPES:
            raise ValueError(f"qgemv: no kernel for {type_name}; one of {sorted(TYPES)}")
        if tiled and not tileable(type_name, n_w, k):
            raise ValueError(f"qgemv: no row tiles for a {type_name} weight of {n_w} x {k} "
                             f"({', '.join(TILE_TYPES)}; rows a multiple of {TILE_ROWS})")
        if not fits(type_name, k) or w.dtype != torch.uint8 or not w.is_contiguous() \
                or w.shape != (n_w, row_bytes(type_name, k)):
            raise ValueError(f"qgemv: a {type_name} weight of {n_w} x {k} is contiguous uint8 "
                             f"[{n_w}, {row_bytes(type_name, k)}] (k a multiple of "
                             f"{BLOCK_VALUES[type_name]}), got {tuple(w.shape)} {w.dtype}")

    def run(self, x: torch.Tensor, w: torch.Tensor, type_name: str, n: int, k: int,
            bias: torch.Tensor | None, out: torch.Tensor, mode: int,
            float_x: bool = False, tiled: bool = False) -> torch.Tensor:
        """The unchecked call (QuantizedLinear checks the weight once): x float32 [rows, k]
        unit stride along k, out float32 [rows, n] unit stride along n. `float_x`: x stays
        in float32, the Q8_0 weight widened in registers (modes 0 and 1; Q8_0 only): the
        LM head's path, where 8-bit x moved the logits too far."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k \
                or (x.stride(1) != 1 and k > 1):
            raise ValueError(f"qgemv: x must be float32 [rows, {k}] with unit stride along k, "
                             f"got {tuple(x.shape)} {x.dtype}")
        fn = self._fx if float_x else self._fn
        rc = fn(x.data_ptr(), x.stride(0), x.shape[0], w.data_ptr(), type_code(type_name, tiled),
                n, k, cpu_ext.address(bias), out.data_ptr(), out.stride(0), mode,
                torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"qgemv: bad type, mode {mode} or k {k}"
                             + (" (float x: Q8_0, modes 0 and 1 only)" if float_x else ""))
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, type_name: str, k: int,
               bias: torch.Tensor | None = None, mode: int = MODE_STORE,
               out: torch.Tensor | None = None, float_x: bool = False,
               tiled: bool = False) -> torch.Tensor:
        """x W^T + b (mode 0), out += x W^T + b (1), or act(gate) * up on W = [gate; up]
        (2 SiLU, 3 GELU-tanh), x float32 [rows, k]."""
        n_w = w.shape[0]
        self.check_weight(w, type_name, n_w, k, tiled)
        n = n_w // 2 if mode >= MODE_SILU_MUL else n_w
        if out is None:
            out = torch.empty((x.shape[0], n), dtype=torch.float32)
        elif out.shape != (x.shape[0], n) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(f"qgemv: out must be float32 [{x.shape[0]}, {n}], unit stride")
        return self.run(x, w, type_name, n, k, bias, out, mode, float_x, tiled)

    def bind(self, w: torch.Tensor, type_name: str, k: int, bias: torch.Tensor | None = None,
             mode: int = MODE_STORE, float_x: bool = False, tiled: bool = False) -> BoundQGemv:
        """The op `mode` on this weight and bias, checked once (see BoundQGemv)."""
        n_w = w.shape[0]
        self.check_weight(w, type_name, n_w, k, tiled)
        n = n_w // 2 if mode >= MODE_SILU_MUL else n_w
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                 or bias.shape != (n_w,)):
            raise ValueError(f"qgemv: bias must be contiguous float32 [{n_w}]")
        if mode not in (MODE_STORE, MODE_ADD, MODE_SILU_MUL, MODE_GELU_MUL) \
                or (float_x and (type_name != "Q8_0" or mode > MODE_ADD)):
            raise ValueError(f"qgemv: bad mode {mode} (float x: Q8_0, modes 0 and 1 only)")
        if tiled and n % TILE_ROWS:
            raise ValueError(f"qgemv: a tiled weight's outputs are a multiple of {TILE_ROWS}")
        return BoundQGemv(self._packed, w, type_code(type_name, tiled), n, k, bias, mode,
                          float_x)

    def dequantize(self, w: torch.Tensor, type_name: str, k: int,
                   out: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
        """The weight as float32 [n, k] (into `out`, a contiguous buffer of at least n * k
        floats, when given)."""
        n = w.shape[0]
        self.check_weight(w, type_name, n, k, tiled)
        if out is None:
            out = torch.empty((n, k), dtype=torch.float32)
        else:
            if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < n * k:
                raise ValueError(f"qgemv: dequantize needs a float32 buffer of {n * k}")
            out = out.view(-1)[: n * k].view(n, k)
        if self._deq(w.data_ptr(), type_code(type_name, tiled), n, k, out.data_ptr(),
                     torch.get_num_threads()) != 0:
            raise ValueError(f"qgemv: bad type {type_name} or k {k}")
        return out

    def pack_tiles(self, w: torch.Tensor, type_name: str, k: int,
                   unpack: bool = False, in_place: bool = False) -> torch.Tensor:
        """The weight's rows (the file's layout) as row tiles: a new uint8 tensor of the
        same shape and bytes in the order csrc/qtiles.h gives (`unpack`: tiles back to
        rows); `in_place` reorders w's own memory and returns w."""
        n = w.shape[0]
        self.check_weight(w, type_name, n, k, tiled=unpack)
        if not tileable(type_name, n, k):
            raise ValueError(f"qgemv: no row tiles for a {type_name} weight of {n} x {k}")
        out = w if in_place else torch.empty_like(w)
        if self._pack(w.data_ptr(), TYPES[type_name], n, k, out.data_ptr(), int(unpack)) != 0:
            raise ValueError(f"qgemv: cannot tile {type_name} {n} x {k}")
        return out

    def embed(self, w: torch.Tensor, type_name: str, k: int, ids: torch.Tensor,
              out: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the quantized table w [n, k] as float32
        [*ids.shape, k]; only those rows are read (IndexError for an id outside 0..n-1)."""
        n = w.shape[0]
        self.check_weight(w, type_name, n, k, tiled)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if out is None:
            out = torch.empty((*ids.shape, k), dtype=torch.float32)
        elif out.dtype != torch.float32 or not out.is_contiguous() \
                or out.shape != (*ids.shape, k):
            raise ValueError(f"qgemv: embed needs a contiguous float32 [{flat.numel()}, {k}]")
        rc = self._embed(w.data_ptr(), type_code(type_name, tiled), n, k, flat.data_ptr(),
                         flat.numel(),
                         out.data_ptr(), torch.get_num_threads())
        if rc == 2:
            raise IndexError(f"qgemv: an id outside the table's {n} rows")
        if rc != 0:
            raise ValueError(f"qgemv: bad type {type_name} or k {k}")
        return out


class BoundQGemv:
    """One projection's kernel with its weight, bias and mode fixed (checked by
    `QGemv.bind`); a call fills in x and the output and makes one ctypes call with a single
    pointer (~3 us less than the checked call; a decode step makes 120). x must be float32
    [rows, k] with unit stride along k (checked: anything else reads out of bounds). Not
    reentrant (the argument array is the op's own), as gemv.BoundGemv."""

    def __init__(self, fn: ctypes._CFuncPtr, w: torch.Tensor, code: int, n: int, k: int,
                 bias: torch.Tensor | None, mode: int, float_x: bool) -> None:
        self._fn = fn
        self._keep = (w, bias)  # the pointers below stay valid while this lives
        self.n, self.k, self.mode = n, k, mode
        a = (ctypes.c_int64 * 13)()
        a[3], a[4], a[5], a[6] = w.data_ptr(), code, n, k
        a[7], a[10], a[12] = cpu_ext.address(bias), mode, int(float_x)
        self._args = a
        self._ptr = ctypes.addressof(a)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, k] -> out [rows, n] (new, or `out` for MODE_ADD: the residual, float32
        with unit stride along n)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k \
                or (x.stride(1) != 1 and self.k > 1):
            raise ValueError(f"qgemv: x must be float32 [rows, {self.k}] with unit stride "
                             f"along k, got {tuple(x.shape)} {x.dtype}")
        rows = x.shape[0]
        if out is None:
            out = torch.empty((rows, self.n), dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (rows, self.n) or out.stride(1) != 1:
            raise ValueError(f"qgemv: out must be float32 [{rows}, {self.n}], unit stride")
        a = self._args
        a[0], a[1], a[2] = x.data_ptr(), x.stride(0), rows
        a[8], a[9], a[11] = out.data_ptr(), out.stride(0), torch.get_num_threads()
        if self._fn(self._ptr) != 0:
            raise ValueError("qgemv: the kernel refused its arguments")
        return out

    def args_address(self, x: torch.Tensor | None, out: torch.Tensor | None,
                     threads: int) -> int:
        """The argument array with x and out (fixed float32 buffers, unit stride; None: the
        caller fills that one in) and the thread count, for kvserve_qdecode_layers, which
        fills in the rows itself."""
        a = self._args
        if x is not None:
            a[0], a[1] = x.data_ptr(), x.stride(0)
        if out is not None:
            a[8], a[9] = out.data_ptr(), out.stride(0)
        a[11] = threads
        return self._ptr

    @property
    def function_address(self) -> int:
        """kvserve_qgemv_packed's C address (what kvserve_qdecode_layers calls)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=1)
def load() -> QGemv | None:
    """The kernel, built on first call; None (logged once by cpu_ext) where it cannot be."""
    return cpu_ext.load_kernel(SOURCE, QGemv, "quantized weights are dequantized at load")
