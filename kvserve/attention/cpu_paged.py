"""Decode attention that reads the paged KV cache in place, on the CPU (csrc/paged_decode.cpp).

Why: the torch backend's decode path gathers every running sequence's whole K/V into a scratch
tensor each layer of each step and then runs SDPA over it with a length mask: the gather alone
was 16% of a batch-64 decode step. This kernel walks each sequence's block table instead, with
an online softmax, so every cached K/V byte is read once and nothing is written but the output.

It reads every storage format of kv/quant.py in place (`paged_kv` maps a layer's codec and parts
to the kernel's arguments): float32, bfloat16, float16, fp8 e4m3 / e5m2 (per-layer scales folded
into q and the output), int8 (fp16 scale and zero per token, head and group) and int4 (KIVI:
keys per channel per block, values per token, and the residual rows of the blocks still
filling), decoding one token row at a time in registers / L1; and a first visible position per
sequence serves sliding-window layers.

The kernel is plain C++ with a C ABI, compiled at first use with the machine's compiler and
loaded with ctypes (`kvserve.kernels.cpu.cpu_ext`: cached per source, flags, compiler and CPU; runs
on torch's OpenMP threads). Where there is no compiler (or the build fails) `load_kernel`
returns None, logs why once, and the backend keeps its gather path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kv.quant import FP8Codec, Int4KIVICodec, Int8Codec, KVCodec
from kvserve.kernels.cpu import CSRC, cpu_ext

logger = logging.getLogger("kvserve")

SOURCE = CSRC / "paged_decode.cpp"
ABI_VERSION = 3
# Limits of the kernel's fixed per-thread buffers (see the .cpp file).
MAX_BLOCK_SIZE = 256
MAX_HEAD_DIM = 1024
# The kernel's storage kinds (`Kind` in the .cpp file).
F32, BF16, F16, FP8_E4M3, FP8_E5M2, INT8, INT4 = range(7)
FLOAT_KINDS = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
FP8_KINDS = {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}


class _Args(ctypes.Structure):
    """`Args` of the .cpp file, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("q", "k", "v", "k_sz", "v_sz", "k_res", "res_rows", "tables", "starts", "lens",
                 "out")] \
        + [(name, ctypes.c_int64) for name in
           ("q_stride", "table_stride", "n", "H", "Hkv", "D", "block_size", "groups")] \
        + [("kind", ctypes.c_int32), ("res_kind", ctypes.c_int32)] \
        + [(name, ctypes.c_float) for name in ("scale", "k_scale", "v_scale")] \
        + [("new_k", ctypes.c_void_p), ("new_v", ctypes.c_void_p),
           ("new_k_stride", ctypes.c_int64), ("new_v_stride", ctypes.c_int64)]


@dataclass
class PagedKV:
    """One layer's cache as the kernel reads it: the pool's own tensors (never a copy) and how
    to decode them (`paged_kv`)."""

    kind: int
    k: torch.Tensor  # [blocks, block_size, Hkv, D] (int4: D / 2 bytes)
    v: torch.Tensor
    head_dim: int
    k_sz: torch.Tensor | None = None  # int8/int4 fp16 (scale, zero) parts
    v_sz: torch.Tensor | None = None
    groups: int = 1
    k_scale: float = 1.0  # fp8's per-layer scales
    v_scale: float = 1.0
    residual: torch.Tensor | None = None  # int4: the layer's KIVI residual rows


def paged_kv(codec: KVCodec, parts: tuple[torch.Tensor, ...], layer: int) -> PagedKV | None:
    """How the kernel reads a layer stored by `codec` in `parts`, or None where it cannot (a
    device other than the CPU, a latent cache, sizes beyond its buffers): then the backend
    gathers. The layouts are kv/quant.py's; fp8's scales are read at each call (the first batch
    may calibrate them)."""
    k = parts[0]
    if k.device.type != "cpu" or len(parts) < 2 or not all(p.is_contiguous() for p in parts):
        return None
    d = codec.head_dim
    if k.dim() != 4 or k.shape[1] > MAX_BLOCK_SIZE or d > MAX_HEAD_DIM or codec.heads <= 0:
        return None
    if isinstance(codec, FP8Codec):
        ks, vs = codec.scales.get(layer)
        return PagedKV(FP8_KINDS[codec.fp8], k, parts[1], d, k_scale=ks, v_scale=vs)
    if isinstance(codec, Int4KIVICodec):
        if (d // codec.groups) % 2:  # a group's codes would not start on a byte
            return None
        tensors = codec.residual.tensors
        residual = tensors[layer] if tensors else None
        if residual is not None and residual.dtype not in FLOAT_KINDS:
            return None
        return PagedKV(INT4, k, parts[1], d, parts[2], parts[3], codec.groups,
                       residual=residual)
    if isinstance(codec, Int8Codec):
        return PagedKV(INT8, k, parts[1], d, parts[2], parts[3], codec.groups)
    if codec.quantized or k.dtype not in FLOAT_KINDS or k.shape[-1] != d:
        return None
    return PagedKV(FLOAT_KINDS[k.dtype], k, parts[1], d)


class PagedDecodeKernel:
    """The loaded library; `__call__` runs one layer's decode attention for a batch."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        path = Path(lib._name)
        if lib.kvserve_paged_decode_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} has a different ABI version")
        fn = lib.kvserve_paged_decode
        fn.argtypes = [ctypes.POINTER(_Args)]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib  # keeps the library loaded
        self.path = path

    @property
    def function_address(self) -> int:
        """The C entry point, for C code that runs the kernel itself (PagedStep.layer_args)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def __call__(self, q: torch.Tensor, kv: PagedKV | torch.Tensor, v_cache: torch.Tensor | None,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                 res_rows: torch.Tensor | None = None) -> torch.Tensor:
        """q [n, H, D] float32 (token rows may be strided; heads and D contiguous); `kv` a
        `PagedKV` (v_cache None), or an unquantized K cache [blocks, block_size, Hkv, D] with
        `v_cache` beside it; tables [n, max_blocks] int64 (entries never read may hold
        anything), lens [n] int64, `starts` [n] int64 the first key position each sequence sees
        (a sliding window; None: 0), `res_rows` [n, max_blocks] int64 int4's residual row per
        table entry (-1: none) -> [n, H, D] float32 (into `out` when given: contiguous,
        float32). One call of `step(...).run(...)`."""
        if isinstance(kv, torch.Tensor):
            kv = PagedKV(FLOAT_KINDS[kv.dtype], kv, v_cache, kv.shape[-1])
        return self.step(tables, lens, starts, res_rows).run(q, kv, scale, out)

    def step(self, tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None = None,
             res_rows: torch.Tensor | None = None) -> PagedStep:
        """A step's decodes (see __call__), checked and packed into the kernel's arguments once
        for all the layers that read them."""
        for t in (tables, lens, starts, res_rows):
            if t is not None and (t.dtype != torch.int64 or t.stride(-1) != 1):
                raise ValueError("paged decode kernel: tables, lengths, starts and residual "
                                 "rows must be int64 with contiguous rows")
        if res_rows is not None and res_rows.stride(0) != tables.stride(0):
            raise ValueError("paged decode kernel: res_rows must have the tables' row stride")
        return PagedStep(self._fn, tables, lens, starts, res_rows)


class PagedStep:
    """One step's decode inputs in the kernel's argument struct; `run` adds one layer's cache
    and queries. Why: the layers of a step share the tables, lengths and window starts, and
    at batch 1 building and checking the whole struct per layer cost as much as the kernel."""

    def __init__(self, fn: ctypes._CFuncPtr, tables: torch.Tensor, lens: torch.Tensor,
                 starts: torch.Tensor | None, res_rows: torch.Tensor | None) -> None:
        self._fn = fn
        self._keep = (tables, lens, starts, res_rows)  # the pointers below stay valid
        self.n = lens.shape[0]
        self._res_rows = res_rows
        self._args = _Args(tables=tables.data_ptr(), starts=cpu_ext.address(starts),
                           lens=lens.data_ptr(), res_rows=cpu_ext.address(res_rows),
                           table_stride=tables.stride(0), n=self.n)

    def run(self, q: torch.Tensor, kv: PagedKV, scale: float, out: torch.Tensor | None = None,
            new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Decode attention of q [n, H, D] over `kv` (see PagedDecodeKernel.__call__). With
        new_k / new_v ([n, Hkv, D] in the cache's float type; rows may be strided, heads and
        D contiguous) the kernel first stores each sequence's new token at position
        lens - 1, as the backend's scatter would."""
        n, h, d = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
            q = q.float().contiguous()
        if out is None:
            out = torch.empty((n, h, d), dtype=torch.float32)
        self._fill(self._args, q, kv, scale, out, new_k, new_v)
        if self._fn(ctypes.byref(self._args)) != 0:
            a = self._args
            raise ValueError(f"paged decode kernel: unsupported shape H={h} Hkv={a.Hkv} D={d} "
                             f"block_size={a.block_size} groups={kv.groups} kind={kv.kind}")
        return out

    def layer_args(self, q: torch.Tensor, kv: PagedKV, scale: float, out: torch.Tensor,
                   new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None
                   ) -> _Args:
        """The arguments `run` would pass, as a struct of their own (the step's fields copied):
        for a caller that runs the kernel itself (gemv.cpp's kvserve_decode_layers, through
        PagedDecodeKernel.function_address). q float32 with heads and D contiguous; out
        contiguous float32."""
        a = _Args.from_buffer_copy(self._args)
        self._fill(a, q, kv, scale, out, new_k, new_v)
        return a

    def _fill(self, a: _Args, q: torch.Tensor, kv: PagedKV, scale: float, out: torch.Tensor,
              new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> None:
        n, h, d = q.shape
        if n != self.n or d != kv.head_dim or q.dtype != torch.float32 or q.stride(2) != 1 \
                or q.stride(1) != d or out.dtype != torch.float32 or not out.is_contiguous() \
                or out.shape != q.shape:
            raise ValueError(f"paged decode kernel: q {tuple(q.shape)} (float32, heads and D "
                             f"contiguous) and out like it for {self.n} sequences of head_dim "
                             f"{kv.head_dim}")
        residual = kv.residual if self._res_rows is not None else None
        if self._res_rows is not None and residual is None:
            raise ValueError("paged decode kernel: residual rows without a residual tensor")
        if new_k is not None:
            for t in (new_k, new_v):
                if t.dtype != kv.k.dtype or t.shape != (n, *kv.k.shape[2:]) \
                        or t.stride(2) != 1 or t.stride(1) != d:
                    raise ValueError("paged decode kernel: new K/V must be [n, Hkv, D] in the "
                                     "cache's dtype, heads and D contiguous")
            a.new_k, a.new_v = new_k.data_ptr(), new_v.data_ptr()
            a.new_k_stride, a.new_v_stride = new_k.stride(0), new_v.stride(0)
        else:
            a.new_k = a.new_v = None
        a.q, a.q_stride, a.out = q.data_ptr(), q.stride(0), out.data_ptr()
        a.k, a.v = kv.k.data_ptr(), kv.v.data_ptr()
        a.k_sz, a.v_sz = cpu_ext.address(kv.k_sz), cpu_ext.address(kv.v_sz)
        a.k_res = cpu_ext.address(residual)
        a.res_kind = FLOAT_KINDS[residual.dtype] if residual is not None else F32
        a.H, a.Hkv, a.D = h, kv.k.shape[2], d
        a.block_size, a.groups, a.kind = kv.k.shape[1], kv.groups, kv.kind
        a.scale, a.k_scale, a.v_scale = scale, kv.k_scale, kv.v_scale


@functools.lru_cache(maxsize=1)
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built on first call; None (logged once) where it cannot be built or the
    environment sets KVSERVE_CPU_PAGED_DECODE=0."""
    if os.environ.get("KVSERVE_CPU_PAGED_DECODE", "1") == "0":
        logger.info("paged decode kernel off (KVSERVE_CPU_PAGED_DECODE=0): gather path")
        return None
    return cpu_ext.load_kernel(SOURCE, PagedDecodeKernel, "decode attention gathers K/V")

