"""Small-batch fp32 GEMV on the CPU (csrc/gemv.cpp): the third GEMM candidate of gemm_select.

Why: at batch 1 a decode step is bound by reading the weights once; MKL's `F.linear` and
oneDNN's packed GEMM are built for many rows and reached about half of the CPU's read
bandwidth at one row. This kernel splits the output features across torch's OpenMP threads,
reads each weight row once and reuses it from L1 for every row of x, and fuses the decoder's
epilogues (bias, the residual add, the gated MLP's act(gate) * up) and, optionally, the
RMSNorm before the projection and the RoPE of q and k after it: at batch 1 each separate torch
op costs more in dispatch than in arithmetic, so a layer is four calls with no intermediate
tensors but their outputs. It reads the row-major weights `F.linear` uses: choosing it
for some row buckets costs no second weight layout.

It is only fast for a few rows (each extra row re-reads W from L1, not memory): gemm_select
measures it for the smallest row bucket only (`MAX_ROWS`). float32 only (bf16 models keep
oneDNN). Where no compiler is found `load()` returns None and the candidate is left out.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import torch

from kvserve.kernels.cpu import cpu_ext

SOURCE = Path(__file__).with_name("csrc") / "gemv.cpp"
ABI_VERSION = 5
MAX_ROWS = 4  # the row counts gemm_select offers it for (its first bucket)
MODE_STORE, MODE_ADD, MODE_SILU_MUL, MODE_GELU_MUL = 0, 1, 2, 3


class Gemv:
    """The loaded kernel. All methods take x [rows, k] float32 with unit stride along k (any
    row stride) and a contiguous float32 weight; anything else is a ValueError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.kvserve_gemv_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{lib._name} has a different ABI version")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.kvserve_gemv_f32
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ctypes.c_int, ctypes.c_int,
                       ptr, ctypes.c_float, ptr, i64, i64, i64]
        fn.restype = ctypes.c_int
        packed = lib.kvserve_gemv_packed
        packed.argtypes = [ctypes.c_void_p]
        packed.restype = ctypes.c_int
        self._packed = packed
        block = lib.kvserve_gemv_mlp_block
        block.argtypes = [ctypes.c_void_p]
        block.restype = ctypes.c_int
        self._mlp_block = block
        layers = lib.kvserve_decode_layers
        layers.argtypes = [ctypes.c_void_p]
        layers.restype = ctypes.c_int
        self.decode_layers = layers  # fast_decode.py's one call per step (see gemv.cpp)
        norm = lib.kvserve_rms_norm_f32
        norm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64, ctypes.c_int]
        norm.restype = ctypes.c_int
        rope = lib.kvserve_rope_f32
        rope.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ctypes.c_int]
        rope.restype = ctypes.c_int
        self._norm, self._rope = norm, rope
        read = lib.kvserve_read_sum_f32
        read.argtypes = [ptr, i64, ctypes.c_int]
        read.restype = ctypes.c_double
        argmax = lib.kvserve_argmax_f32
        argmax.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
        argmax.restype = ctypes.c_int
        self._argmax = argmax
        self._fn = fn
        self._read = read
        self._lib = lib  # keeps the library loaded

    @staticmethod
    def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n_w: int,
               norm_weight: torch.Tensor | None = None) -> None:
        if x.dtype != torch.float32 or w.dtype != torch.float32:
            raise ValueError(f"gemv: float32 only, got x {x.dtype}, weight {w.dtype}")
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight "
                             f"{tuple(w.shape)}")
        if x.device.type != "cpu" or w.device.type != "cpu":
            raise ValueError("gemv: CPU tensors only")
        if not w.is_contiguous() or (x.stride(1) != 1 and x.shape[1] > 1):
            raise ValueError("gemv: the weight must be contiguous and x unit-strided along k")
        if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()
                              or b.shape != (n_w,)):
            raise ValueError(f"gemv: bias must be contiguous float32 [{n_w}]")
        if norm_weight is not None and (norm_weight.dtype != torch.float32
                                        or not norm_weight.is_contiguous()
                                        or norm_weight.shape != (w.shape[1],)):
            raise ValueError(f"gemv: norm weight must be contiguous float32 [{w.shape[1]}]")

    def _run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int,
             out: torch.Tensor, mode: int, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, cos_sin: torch.Tensor | None = None, rope_cols: int = 0,
             head_dim: int = 0) -> torch.Tensor:
        rc = self._fn(x.data_ptr(), x.stride(0), x.shape[0], w.data_ptr(),
                      cpu_ext.address(b), n, w.shape[1], out.data_ptr(),
                      out.stride(0), mode, torch.get_num_threads(),
                      cpu_ext.address(norm_weight), eps,
                      cpu_ext.address(cos_sin),
                      0 if cos_sin is None else cos_sin.stride(0), rope_cols, head_dim)
        if rc != 0:
            raise ValueError(f"gemv: bad mode {mode} or RoPE layout (rope_cols {rope_cols}, "
                             f"head_dim {head_dim}, {n} outputs)")
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               cos_sin: torch.Tensor | None = None, rope_cols: int = 0, head_dim: int = 0
               ) -> torch.Tensor:
        """x W^T + b -> new [rows, n] (F.linear). With `norm_weight`, x is RMS-normed first
        (`kvserve.layers.norm.rms_norm(x, norm_weight, eps)`); with `cos_sin` ([rows, head_dim]: cos |
        sin halves, unit stride along head_dim), the first `rope_cols` outputs of each row
        are heads of `head_dim` rotated in place after (`kvserve.layers.rotary.apply_rope`)."""
        self._check(x, w, b, w.shape[0], norm_weight)
        if cos_sin is not None and (cos_sin.dtype != torch.float32 or cos_sin.stride(1) != 1
                                    or cos_sin.shape != (x.shape[0], head_dim)):
            raise ValueError(f"gemv: cos_sin must be float32 [{x.shape[0]}, {head_dim}] with "
                             "unit stride along head_dim")
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
        return self._run(x, w, b, w.shape[0], out, MODE_STORE, norm_weight, eps, cos_sin,
                         rope_cols, head_dim)

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None = None) -> torch.Tensor:
        """residual += x W^T + b, in place; returns residual ([rows, n] float32, unit stride
        along n)."""
        self._check(x, w, b, w.shape[0])
        if residual.dtype != torch.float32 or residual.shape != (x.shape[0], w.shape[0]) \
                or residual.stride(1) != 1:
            raise ValueError(f"gemv: residual must be float32 [{x.shape[0]}, {w.shape[0]}] "
                             "with unit stride along features")
        return self._run(x, w, b, w.shape[0], residual, MODE_ADD)

    def gated(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
              gelu: bool = False, *, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6) -> torch.Tensor:
        """w = [gate; up] ([2i, k]) -> act(x gate^T + b_g) * (x up^T + b_u), new [rows, i];
        act SiLU, or GELU-tanh with `gelu`; x RMS-normed first with `norm_weight`."""
        self._check(x, w, b, w.shape[0], norm_weight)
        if w.shape[0] % 2:
            raise ValueError(f"gemv: a [gate; up] weight has an even row count, got {w.shape[0]}")
        i = w.shape[0] // 2
        out = torch.empty((x.shape[0], i), dtype=torch.float32)
        return self._run(x, w, b, i, out, MODE_GELU_MUL if gelu else MODE_SILU_MUL,
                         norm_weight, eps)

    def bind(self, w: torch.Tensor, b: torch.Tensor | None = None, mode: int = MODE_STORE, *,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6, rope_cols: int = 0,
             head_dim: int = 0) -> BoundGemv:
        """The op `mode` on this weight, bias and norm, checked once: the decoder's per-layer
        calls, whose x it makes itself (see BoundGemv)."""
        n_w = w.shape[0]
        self._check(torch.empty(1, w.shape[1]), w, b, n_w, norm_weight)
        if mode >= MODE_SILU_MUL and n_w % 2:
            raise ValueError(f"gemv: a [gate; up] weight has an even row count, got {n_w}")
        if rope_cols and (mode > MODE_ADD or head_dim <= 0 or head_dim % 2
                          or rope_cols % head_dim or rope_cols > n_w):
            raise ValueError(f"gemv: bad RoPE layout (rope_cols {rope_cols}, head_dim "
                             f"{head_dim}, {n_w} outputs)")
        return BoundGemv(self._packed, w, b, mode, norm_weight, eps, rope_cols, head_dim)

    def bind_mlp_block(self, o_w: torch.Tensor, o_b: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float, gate_up_w: torch.Tensor,
                       gate_up_b: torch.Tensor | None, down_w: torch.Tensor,
                       down_b: torch.Tensor | None, gelu: bool = False) -> BoundMLPBlock:
        """A decoder layer after attention as one call (see BoundMLPBlock), weights checked
        once: o [hidden, q], gate/up [2 inter, hidden], down [hidden, inter]."""
        hidden, q_size = o_w.shape
        inter = down_w.shape[1]
        self._check(torch.empty(1, q_size), o_w, o_b, hidden)
        self._check(torch.empty(1, hidden), gate_up_w, gate_up_b, 2 * inter, norm_weight)
        self._check(torch.empty(1, inter), down_w, down_b, hidden)
        if gate_up_w.shape[0] != 2 * inter or down_w.shape[0] != hidden:
            raise ValueError(f"gemv: an MLP block of o {tuple(o_w.shape)}, gate/up "
                             f"{tuple(gate_up_w.shape)}, down {tuple(down_w.shape)} does not "
                             "fit together")
        return BoundMLPBlock(self._mlp_block, o_w, o_b, norm_weight, eps, gate_up_w, gate_up_b,
                             down_w, down_b, gelu)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """layers.norm.rms_norm of float32 x [rows, k] (unit stride along k) -> new [rows, k]."""
        k = x.shape[-1]
        if x.dtype != torch.float32 or x.dim() != 2 or (x.stride(1) != 1 and k > 1) \
                or weight.dtype != torch.float32 or weight.shape != (k,) \
                or not weight.is_contiguous():
            raise ValueError(f"rms_norm: float32 [rows, k] x and [k] weight, got x "
                             f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}")
        out = torch.empty(x.shape, dtype=torch.float32)
        self._norm(x.data_ptr(), x.stride(0), x.shape[0], k, weight.data_ptr(), eps,
                   out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    def rope_(self, y: torch.Tensor, cos_sin: torch.Tensor, cols: int, head_dim: int
              ) -> torch.Tensor:
        """Rotate the first `cols` columns of float32 y [rows, n] (unit stride along n), heads
        of `head_dim`, by cos_sin [rows, head_dim] (cos | sin halves), in place
        (layers.rotary.apply_rope's rotation); returns y."""
        rows = y.shape[0]
        if y.dtype != torch.float32 or y.dim() != 2 or y.stride(1) != 1 or cols > y.shape[1] \
                or cos_sin.dtype != torch.float32 or cos_sin.shape != (rows, head_dim) \
                or cos_sin.stride(1) != 1:
            raise ValueError(f"rope_: float32 y [rows, >= {cols}] and cos_sin [rows, "
                             f"{head_dim}], got {tuple(y.shape)}, {tuple(cos_sin.shape)}")
        if self._rope(y.data_ptr(), y.stride(0), rows, cols, head_dim, cos_sin.data_ptr(),
                      cos_sin.stride(0), torch.get_num_threads()) != 0:
            raise ValueError(f"rope_: {cols} columns are not heads of {head_dim}")
        return y

    @staticmethod
    def takes_argmax(x: torch.Tensor) -> bool:
        """Whether `argmax` runs on x: [rows, n > 0] float32 CPU rows with unit stride."""
        return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" \
            and x.stride(1) == 1 and x.shape[1] > 0

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row argmax of x [rows, n] (float32, unit stride along n) as int64 [rows]: the first
        maximum, or the first NaN of a row that has one (as NumPy and torch)."""
        if not self.takes_argmax(x):
            raise ValueError(f"argmax: [rows, n > 0] float32 CPU rows with unit stride, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                     torch.get_num_threads())
        return out

    def read_sum(self, t: torch.Tensor) -> float:
        """Sum of a contiguous float32 tensor, read once on torch's threads (the benchmarks'
        read-bandwidth probe)."""
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("read_sum: contiguous float32 only")
        return self._read(t.data_ptr(), t.numel(), torch.get_num_threads())


class BoundGemv:
    """One projection's GEMV with its weights, bias, norm and mode fixed (checked by
    `Gemv.bind`); a call only fills in x, the output and cos_sin and makes one ctypes call
    with a single pointer (about 2 us instead of about 12 for the checked methods: at batch 1
    there are 33 such calls per step). x must be float32 [rows, k] with unit stride along k:
    rows past the weight's k or a strided k would read out of bounds, so those two are still
    checked. Not reentrant (the argument array is the op's own): one model's forward runs on
    one thread at a time, as the engine runs it."""

    def __init__(self, fn: ctypes._CFuncPtr, w: torch.Tensor, b: torch.Tensor | None,
                 mode: int, norm_weight: torch.Tensor | None, eps: float, rope_cols: int,
                 head_dim: int) -> None:
        self._fn = fn
        self._keep = (w, b, norm_weight)  # the pointers below stay valid while this lives
        self.k = w.shape[1]
        self.n = w.shape[0] // 2 if mode >= MODE_SILU_MUL else w.shape[0]
        self.mode = mode
        self.rope_cols = rope_cols
        a = (ctypes.c_int64 * 17)()
        a[3] = w.data_ptr()
        a[4] = cpu_ext.address(b)
        a[5], a[6], a[9] = self.n, self.k, mode
        a[11] = cpu_ext.address(norm_weight)
        a[12] = struct.unpack("<i", struct.pack("<f", eps))[0]
        a[15], a[16] = rope_cols, head_dim
        self._args = a
        self._ptr = ctypes.addressof(a)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, k] -> new [rows, n] (into `out` for MODE_ADD: the residual, [rows, n]
        with unit stride along n); cos_sin [rows, head_dim] when bound with rope_cols."""
        if x.shape[1] != self.k or (x.stride(1) != 1 and self.k > 1) \
                or x.dtype != torch.float32:
            raise ValueError(f"gemv: x must be float32 [rows, {self.k}] with unit stride "
                             f"along k, got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
        rows = x.shape[0]
        if out is None:
            out = torch.empty((rows, self.n), dtype=torch.float32)
        a = self._args
        a[0], a[1], a[2] = x.data_ptr(), x.stride(0), rows
        a[7], a[8], a[10] = out.data_ptr(), out.stride(0), torch.get_num_threads()
        if self.rope_cols:
            a[13], a[14] = cos_sin.data_ptr(), cos_sin.stride(0)
        if self._fn(self._ptr) != 0:
            raise ValueError("gemv: bad mode or RoPE layout")
        return out

    def args_address(self, out: torch.Tensor, threads: int) -> int:
        """The argument array with the output [rows, n] (a fixed buffer) and the thread count
        filled in, for kvserve_decode_layers, which fills in x, its rows and cos_sin itself."""
        self._args[7], self._args[8], self._args[10] = out.data_ptr(), out.stride(0), threads
        return self._ptr


class BoundMLPBlock:
    """residual += o W_o^T + b_o, then residual += down(act(gate(n)) * up(n)) with n the
    RMS-normed residual: the rest of a decoder layer after attention, at a few rows, in one
    C++ call and one parallel region (it was three calls, each a fork and join of the
    threads, and the Python between them). Weights fixed by `Gemv.bind_mlp_block`; not
    reentrant (one argument array and scratch), as BoundGemv."""

    def __init__(self, fn: ctypes._CFuncPtr, o_w: torch.Tensor, o_b: torch.Tensor | None,
                 norm_w: torch.Tensor, eps: float, gu_w: torch.Tensor,
                 gu_b: torch.Tensor | None, d_w: torch.Tensor, d_b: torch.Tensor | None,
                 gelu: bool) -> None:
        self._fn = fn
        self._keep = (o_w, o_b, norm_w, gu_w, gu_b, d_w, d_b)
        self.hidden, self.q_size = o_w.shape
        self.inter = d_w.shape[1]
        self._m = torch.empty(MAX_ROWS * self.inter, dtype=torch.float32)
        a = (ctypes.c_int64 * 19)()
        a[17] = self._m.data_ptr()
        a[5], a[6] = o_w.data_ptr(), cpu_ext.address(o_b)
        a[7], a[8] = self.hidden, self.q_size
        a[9], a[10] = norm_w.data_ptr(), struct.unpack("<i", struct.pack("<f", eps))[0]
        a[11], a[12], a[13] = gu_w.data_ptr(), cpu_ext.address(gu_b), self.inter
        a[14] = MODE_GELU_MUL if gelu else MODE_SILU_MUL
        a[15], a[16] = d_w.data_ptr(), cpu_ext.address(d_b)
        self._args = a
        self._ptr = ctypes.addressof(a)

    def __call__(self, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o [rows, q] (unit stride along q), residual [rows, hidden] float32 (unit stride
        along hidden), updated in place and returned."""
        rows = o.shape[0]
        if o.dtype != torch.float32 or residual.dtype != torch.float32 \
                or o.shape[1] != self.q_size or (o.stride(1) != 1 and self.q_size > 1) \
                or residual.shape != (rows, self.hidden) or residual.stride(1) != 1:
            raise ValueError(f"gemv: an MLP block takes float32 o [rows, {self.q_size}] and "
                             f"residual [rows, {self.hidden}] with unit strides, got "
                             f"{tuple(o.shape)} and {tuple(residual.shape)}")
        if rows > MAX_ROWS:
            raise ValueError(f"gemv: an MLP block takes at most {MAX_ROWS} rows, got {rows}")
        a = self._args
        a[0], a[1], a[2] = o.data_ptr(), o.stride(0), rows
        a[3], a[4] = residual.data_ptr(), residual.stride(0)
        a[18] = torch.get_num_threads()
        if self._fn(self._ptr) != 0:
            raise ValueError("gemv: bad MLP block mode")
        return residual

    def args_address(self, o: torch.Tensor, threads: int) -> int:
        """The argument array with o [rows, q] (a fixed buffer) and the thread count filled
        in, for kvserve_decode_layers, which fills in the rows and the residual itself."""
        self._args[0], self._args[1], self._args[18] = o.data_ptr(), o.stride(0), threads
        return self._ptr


@functools.lru_cache(maxsize=1)
def load() -> Gemv | None:
    """The kernel, built on first call; None (logged once by cpu_ext) where it cannot be."""
    return cpu_ext.load_kernel(SOURCE, Gemv, "projections stay on MKL/oneDNN")
