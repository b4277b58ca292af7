"""A float32 GEMM for decode-sized batches on weights packed in panels (csrc/panel_gemm.cpp):
the fourth GEMM candidate of gemm_select.

Why: at 64 rows oneDNN and MKL reach their speed only with the weights in cache, and in an
engine step they are not (each step reads every weight and the running sequences' K/V, more
than the L3 keeps): the projections ran ~1.5x slower in the engine than in a loop on one
layer's weights. This kernel streams each panel of 32 output features once, keeps a tile of
rows' accumulators in registers over all of K, and prefetches the next panel while it
computes; the bias and the residual add are its epilogue. Measured at 64 rows on this
project's AVX-512 CPU: ~310 GFLOP/s with the weights hot, and 3-33% slower cold, where oneDNN
lost 5-76%. It also takes the element-wise work around a decoder layer's projections: the
RMSNorm before one (the rows normed in the same call, into a buffer that stays in cache) and
the gated activation after gate/up (act(gate) * up, written without the [rows, 2 x
intermediate] product).

gemm_select times it against the others at every row bucket on the model's own weights and
uses it where it wins. It reads its own layout (a packed copy, like oneDNN's): a projection
that mixes it with a row-major kernel keeps both. float32 only; without a compiler `load()`
returns None and the candidate is left out.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.utils import hugepages
from kvserve.kernels.cpu import cpu_ext

SOURCE = Path(__file__).with_name("csrc") / "panel_gemm.cpp"
ABI_VERSION = 2
# The gated epilogues (csrc/panel_gemm.cpp's Act), by transformers' hidden_act names
ACTS = {"silu": 1, "gelu_pytorch_tanh": 2}


class _Args(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("residual", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("x_stride", ctypes.c_int64), ("rows", ctypes.c_int64), ("k", ctypes.c_int64),
                ("n", ctypes.c_int64), ("residual_stride", ctypes.c_int64),
                ("out_stride", ctypes.c_int64), ("threads", ctypes.c_int32),
                ("act", ctypes.c_int32), ("cols", ctypes.c_int64), ("norm", ctypes.c_void_p),
                ("eps", ctypes.c_float)]


@dataclass(frozen=True)
class PanelWeight:
    """W [n, k] in the kernel's layout: [ceil(cols / width), k, width] float32, zero past
    cols. `act`: W was gate | up ([2 n, k]), its columns now in (gate, up) pairs of `lanes`
    (zero-padded: a layout of the build that packed it), and the kernel writes act(gate) * up,
    n wide."""

    packed: torch.Tensor
    n: int
    k: int
    cols: int
    act: str | None = None
    lanes: int = 0


class PanelGemm:
    """The loaded kernel: `pack` a weight once, then `linear` any number of times."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.kvserve_panel_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{lib._name} has a different ABI version")
        self.width = lib.kvserve_panel_width()
        self.lanes = lib.kvserve_panel_lanes()
        fn = lib.kvserve_panel_gemm
        fn.argtypes = [ctypes.POINTER(_Args)]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib  # keeps the library loaded
        self.path = Path(lib._name)

    def pack(self, w: torch.Tensor, act: str | None = None) -> PanelWeight:
        """A packed copy of w [n, k] (float32, on 2 MiB pages where the kernel allows). act (a
        key of ACTS): w is a gated MLP's gate | up [2 i, k] and the GEMM returns act(gate) *
        up [rows, i]."""
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"panel GEMM packs 2-D float32 CPU weights, got {tuple(w.shape)} "
                             f"{w.dtype} on {w.device}")
        n, k = w.shape
        w, width, lanes = w.detach(), self.width, self.lanes
        if act is not None:
            if act not in ACTS or n % 2:
                raise ValueError(f"panel GEMM: a gated activation of {sorted(ACTS)} over gate | "
                                 f"up rows, got {act!r} over {n} rows")
            n //= 2
            per = width // (2 * lanes)  # (gate, up) pairs per panel
            if n % (lanes * per) == 0:  # whole panels of pairs: one strided copy
                panels = n // (lanes * per)
                packed = _empty(panels, k, width)
                packed.view(panels, k, per, 2, lanes).copy_(
                    w.view(2, panels, per, lanes, k).permute(1, 4, 2, 0, 3))
                return PanelWeight(packed, n, k, 2 * n, act, lanes)
            w = self._gated_order(w)
        cols = w.shape[0]
        full, rest = divmod(cols, width)
        packed = _empty(full + (rest > 0), k, width)
        packed[:full].copy_(w[:full * width].view(full, width, k).transpose(1, 2))
        if rest:
            packed[full].zero_()
            packed[full, :, :rest].copy_(w[full * width:].t())
        return PanelWeight(packed, n, k, cols, act, lanes)

    def _gated_order(self, t: torch.Tensor) -> torch.Tensor:
        """gate | up rows (or a bias's entries) [2 i, ...] -> (gate, up) pairs of `lanes`
        rows, the last pair zero-padded: what a tile of two vectors turns into one of act(gate)
        * up."""
        i, lanes, rest = t.shape[0] // 2, self.lanes, tuple(t.shape[1:])
        groups = -(-i // lanes)
        padded = t.new_zeros((2, groups * lanes) + rest)  # gate, up: each padded to groups
        padded[:, :i] = t.view((2, i) + rest)
        return padded.view((2, groups, lanes) + rest).transpose(0, 1).reshape((-1,) + rest)

    def linear(self, x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
        """x [rows, k] float32 (unit stride along k) -> x W^T + bias [rows, n]; with `residual`
        ([rows, n], unit stride along n, not overlapping x) the sum is added to it in place
        and returned. One call of `bind(w, bias, norm_weight, eps)(x, residual)`."""
        return self.bind(w, bias, norm_weight, eps)(x, residual)

    def bind(self, w: PanelWeight, bias: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> BoundPanel:
        """`linear` with w and bias fixed (see BoundPanel). A gated w takes gate | up's bias
        [2 n]. norm_weight [k]: x's rows are RMS-normed (layers.norm.rms_norm with eps) first, in
        the same call."""
        want = 2 * w.n if w.act else w.n
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (want,)
                                 or not bias.is_contiguous()):
            raise ValueError(f"panel GEMM: bias must be a contiguous float32 [{want}]")
        if norm_weight is not None and (norm_weight.dtype != torch.float32
                                        or norm_weight.shape != (w.k,)
                                        or not norm_weight.is_contiguous()):
            raise ValueError(f"panel GEMM: norm weight must be a contiguous float32 [{w.k}]")
        if w.act and w.lanes != self.lanes:
            raise ValueError(f"panel GEMM: a gated weight packed for {w.lanes}-float vectors, "
                             f"this kernel's are {self.lanes}")
        if bias is not None and w.act:
            bias = self._gated_order(bias)
        return BoundPanel(self._fn, w, bias, norm_weight, eps)


def _empty(*shape: int) -> torch.Tensor:
    """float32 on memory of its own, on 2 MiB pages where the kernel gives them."""
    return hugepages.empty(shape, torch.float32)


class BoundPanel:
    """A projection's `PanelGemm.linear` with its weight and bias fixed: the argument struct is
    built once and each call fills in only x, the output and the residual (~1 us less per call
    than building it: ~6 us of Python per GEMM, ~40 GEMMs in a batch-64 step)."""

    def __init__(self, fn: ctypes._CFuncPtr, w: PanelWeight, bias: torch.Tensor | None,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
        self._fn = fn
        self.w, self.bias, self.norm_weight = w, bias, norm_weight  # the pointers stay valid
        self._args = _Args(w=w.packed.data_ptr(), bias=cpu_ext.address(bias), k=w.k, n=w.n,
                           act=ACTS[w.act] if w.act else 0, cols=w.cols,
                           norm=cpu_ext.address(norm_weight), eps=eps)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        w = self.w
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" \
                or x.shape[1] != w.k or (x.stride(1) != 1 and w.k > 1):
            raise ValueError(f"panel GEMM: x must be [rows, {w.k}] float32 on the CPU with unit "
                             f"stride along k, got {tuple(x.shape)} {x.dtype} on {x.device}")
        rows = x.shape[0]
        if residual is not None and w.act:
            raise ValueError("panel GEMM: no residual add after a gated activation")
        if residual is not None:
            if residual.dtype != torch.float32 or residual.shape != (rows, w.n) \
                    or residual.stride(1) != 1:
                raise ValueError(f"panel GEMM: residual must be [{rows}, {w.n}] float32 with "
                                 "unit stride along n")
            out = residual
        else:
            out = torch.empty(rows, w.n, dtype=torch.float32)
        if rows == 0:
            return out
        a = self._args
        a.x, a.x_stride, a.rows = x.data_ptr(), x.stride(0), rows
        a.out, a.out_stride = out.data_ptr(), out.stride(0)
        a.residual = cpu_ext.address(residual)
        a.residual_stride = 0 if residual is None else residual.stride(0)
        a.threads = torch.get_num_threads()
        if self._fn(ctypes.byref(a)) != 0:
            raise ValueError(f"panel GEMM: unsupported sizes rows={rows} k={w.k} n={w.n}")
        return out


@functools.lru_cache(maxsize=1)
def load() -> PanelGemm | None:
    """The kernel, built on first call; None (logged once by cpu_ext) where it cannot be."""
    return cpu_ext.load_kernel(SOURCE, PanelGemm, "projections stay on MKL/oneDNN")


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the panel GEMM can run this model's projections."""
    return device.type == "cpu" and dtype == torch.float32 and load() is not None
