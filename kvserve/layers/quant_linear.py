"""Linear methods on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
kept as the file stores them (issue 31): `QuantizedLinear` (x W^T + b, the residual add) and
`QuantizedGated` (the gate | up projection with act(gate) * up), both on `QuantWeight`s,
`quantized_methods`, a DecoderLayer's `LayerMethods` on them, and `QuantizedEmbedding`, the
token lookup on a quantized table (the tied LM head's weight too: one copy for both).

Why: batch-1 decode reads every weight once a step, so bytes per weight decide its speed;
Q4_1 is 20 bytes per 32 weights, the fp32 copy kvserve dequantized at load 128.

Each method runs the one `KernelChoice` its weight got at load (kernel_choice.py: the layout
the blocks are repacked into, and `int_rows`, measured when the method is made): up to
`int_rows` rows the C++ kernel (kernels/cpu/qgemv.py: x quantized to 8-bit blocks, integer
dot products on the weight blocks, cache-tiled past a few rows); above, the weight is
dequantized into a scratch buffer shared by every projection (one at a time: a model's
forward runs on one thread) and F.linear (MKL) runs on it. `apply` chooses nothing.

The model code never sees these (tests/test_architecture.py): the loader hands a GGUF file's
blocks to the projection that owns them (`Linear.take_blocks`) in place of its float weight,
and the layer's
method (`cpu_methods.QuantizedDecoder`, chosen by the plan when the layer was built) makes
these from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import qgemv
from kvserve.layers import kernel_choice
from kvserve.layers.activation import gated
from kvserve.layers.block import LayerMethods, normed, split_qkv
from kvserve.layers.kernel_choice import KernelChoice
from kvserve.layers.linear import LinearMethod, with_output_norm
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope

# int_rows=None: the choice's (kernel_choice.choose, then measured when the method is made)
INT_ROWS = None


@dataclass(frozen=True)
class QuantWeight:
    """A [n, k] weight as GGUF blocks: `data` uint8 [n, row bytes], row by row (32 values a
    block, 256 for the K-quants), or with `tiled` the same bytes in row tiles of 16 output
    features (csrc/qtiles.h: what the batched AVX-512 kernel reads; `for_kernels`)."""

    data: torch.Tensor
    type_name: str
    k: int
    tiled: bool = False

    def __post_init__(self) -> None:
        qgemv.QGemv.check_weight(self.data, self.type_name, self.data.shape[0], self.k,
                                 self.tiled)

    @classmethod
    def for_kernels(cls, data: torch.Tensor, type_name: str, k: int) -> "QuantWeight":
        """The file-layout blocks `data`, given over (no one else may hold them), in the
        layout `kernel_choice.choose` gives them (row tiles where the tile kernel pays for
        the type and the shape has tiles), tiled in place, so a load never holds a weight
        twice."""
        choice = kernel_choice.choose(type_name, (data.shape[0], k))
        if choice.layout != "tiles":
            return cls(data, type_name, k)
        return cls(qgemv.load().pack_tiles(data, type_name, k, in_place=True), type_name, k,
                   tiled=True)

    def row_blocks(self) -> torch.Tensor:
        """The blocks in the file's row layout (`data` itself unless tiled)."""
        return qgemv.load().pack_tiles(self.data, self.type_name, self.k, unpack=True) \
            if self.tiled else self.data

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [n, k] (into `out`'s memory when given)."""
        return qgemv.load().dequantize(self.data, self.type_name, self.k, out, self.tiled)


@dataclass(frozen=True)
class StackedQuantWeight:
    """A fused [n, k] weight whose row ranges are blocks of different types (`parts`, top to
    bottom): llama.cpp's Q4_K_M files give attn_v another type than attn_q / attn_k, so a
    fused qkv is q and k in one type and v in another. Each part runs its own kernel call
    into its columns of the output (`bind_weight`); the loader used to keep such a
    projection dense, in float32 (SmolLM2's Q4_K_M: 25 MB more than the file)."""

    parts: tuple[QuantWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({p.k for p in self.parts}) != 1:
            raise ValueError("a stacked weight is two or more parts of one width")

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(p.type_name for p in self.parts)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = torch.empty(self.n * self.k, dtype=torch.float32) if out is None else out
        full, row = flat[: self.n * self.k].view(self.n, self.k), 0
        for p in self.parts:
            p.dequantize(full[row: row + p.n])
            row += p.n
        return full


class StackedBound:
    """A StackedQuantWeight's op (MODE_STORE or MODE_ADD): one bound kernel per part, each
    writing its columns of the output (a column slice: unit stride along n, the full row
    stride), as BoundQGemv's call."""

    def __init__(self, weight: StackedQuantWeight, bias: torch.Tensor | None, mode: int,
                 float_x: bool) -> None:
        kernel, self.n, self.k = qgemv.load(), weight.n, weight.k
        self.parts, row = [], 0
        for p in weight.parts:
            b = None if bias is None else bias[row: row + p.n]
            self.parts.append((kernel.bind(p.data, p.type_name, p.k, b, mode, float_x, p.tiled),
                               row, row + p.n))
            row += p.n

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        for op, c0, c1 in self.parts:
            op(x, out[:, c0:c1])
        return out


def kept_as_blocks(attr: str, type_names: tuple[str, ...] | set[str], k: int) -> bool:
    """Whether a loader keeps projection `attr` (a block.PROJECTION_ATTRS name) in block format when
    its checkpoint parts have these types and width k: every type one the kernels run at k;
    parts of different types only outside the gated gate | up (one kernel computes both
    halves), as a StackedQuantWeight. The loader's rule and the planner's."""
    return all(qgemv.fits(t, k) for t in type_names) \
        and (len(set(type_names)) == 1 or attr != "gate_up_proj")


def bind_weight(weight: "QuantWeight | StackedQuantWeight", bias: torch.Tensor | None,
                mode: int, float_x: bool = False):
    """The op `mode` on a weight (qgemv.BoundQGemv, or StackedBound for a stacked one)."""
    if isinstance(weight, StackedQuantWeight):
        if mode not in (qgemv.MODE_STORE, qgemv.MODE_ADD):
            raise ValueError("a stacked weight runs the plain and the residual modes only")
        return StackedBound(weight, bias, mode, float_x)
    return qgemv.load().bind(weight.data, weight.type_name, weight.k, bias, mode, float_x,
                             weight.tiled)


def choice_of(w: "QuantWeight | StackedQuantWeight", float_x: bool = False) -> KernelChoice:
    """The kernel choice of `w` as laid out (its int_rows None where it is to be measured)."""
    parts = w.parts if isinstance(w, StackedQuantWeight) else (w,)
    dtype = "float-x" if float_x else "float32"
    return kernel_choice.stacked([
        kernel_choice.choose(p.type_name, p.shape, dtype, layout="tiles" if p.tiled else "rows")
        for p in parts])


def made_choice(w: "QuantWeight | StackedQuantWeight", int_rows: float | None, label: str,
                run_int: Callable, run_dequant: Callable, float_x: bool = False
                ) -> KernelChoice:
    """`w`'s choice with its int_rows: `int_rows` where given, else measured now (at load,
    once per shape class `label`) where the choice leaves it open."""
    choice = choice_of(w, float_x)
    if int_rows is not None:
        return replace(choice, int_rows=int_rows)
    return kernel_choice.measured(choice, f"{layout_name(w)}{label} {w.n}x{w.k}", w.k,
                                  run_int, run_dequant)


def layout_name(w: "QuantWeight | StackedQuantWeight") -> str:
    """The type and layout a crossover is measured for (tiles run another kernel)."""
    parts = w.parts if isinstance(w, StackedQuantWeight) else (w,)
    return "+".join(p.type_name + (" tiles" if p.tiled else "") for p in parts)


_scratch: list[torch.Tensor] = [torch.empty(0)]


def dequantized(w: "QuantWeight | StackedQuantWeight") -> torch.Tensor:
    """w as float32 [n, k] in the shared scratch buffer (valid until the next call)."""
    if _scratch[0].numel() < w.n * w.k:
        _scratch[0] = torch.empty(w.n * w.k, dtype=torch.float32)
    return w.dequantize(_scratch[0])


class QuantizedLinear(LinearMethod):
    """x W^T + b on a QuantWeight: the C++ kernel up to `int_rows` rows (x quantized to 8
    bits, or with `float_x` kept in float32: Q8_0 only, the LM head's), MKL on a dequantized
    copy above; int_rows None: the weight's KernelChoice's (measured here, at load)."""

    __slots__ = ("weight", "bias", "int_rows", "float_x", "choice", "_store", "_add")

    def __init__(self, weight: "QuantWeight | StackedQuantWeight",
                 bias: torch.Tensor | None = None, int_rows: float | None = INT_ROWS,
                 float_x: bool = False) -> None:
        if float_x and weight.type_name != "Q8_0":
            raise ValueError(f"float x runs on Q8_0 weights only, not {weight.type_name}")
        self.weight, self.bias, self.float_x = weight, bias, float_x
        self._store = bind_weight(weight, bias, qgemv.MODE_STORE, float_x)
        self._add = bind_weight(weight, bias, qgemv.MODE_ADD, float_x)
        self.choice = made_choice(weight, int_rows, " float-x" if float_x else "", self._store,
                                  lambda x: F.linear(x, dequantized(weight), bias), float_x)
        self.int_rows = self.choice.int_rows

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.int_rows:
            return self._store(x)
        return F.linear(x, dequantized(self.weight), self.bias)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.int_rows and residual.stride(1) == 1:
            return self._add(x, residual)
        residual.addmm_(x, dequantized(self.weight).t())
        return residual if self.bias is None else residual.add_(self.bias)


class QuantizedGated(LinearMethod):
    """The gate | up projection on a QuantWeight [2i, k]: act(x gate^T + b_g) * (x up^T +
    b_u), fused into the integer kernel up to `int_rows` rows (None: the weight's
    KernelChoice's, measured here, at load)."""

    __slots__ = ("weight", "bias", "intermediate", "gelu", "int_rows", "choice", "_gated")

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, intermediate: int,
                 gelu: bool, int_rows: float | None = INT_ROWS) -> None:
        if weight.n != 2 * intermediate:
            raise ValueError(f"a [gate; up] weight has {2 * intermediate} rows, got {weight.n}")
        self.weight, self.bias, self.intermediate, self.gelu = weight, bias, intermediate, gelu
        mode = qgemv.MODE_GELU_MUL if gelu else qgemv.MODE_SILU_MUL
        self._gated = bind_weight(weight, bias, mode)
        self.choice = made_choice(weight, int_rows, " gated", self._gated, self._dequant_path)
        self.int_rows = self.choice.int_rows

    def _dequant_path(self, x: torch.Tensor) -> torch.Tensor:
        return gated(F.linear(x, dequantized(self.weight), self.bias), self.intermediate,
                     self.gelu)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.int_rows:
            return self._gated(x)
        return self._dequant_path(x)


class QuantizedEmbedding:
    """ids -> the rows of a quantized table as float32 (the kernel dequantizes only the rows
    looked up). Why not a float copy: a tied table is also the LM head's weight, and SmolLM2's
    is 113 MB in float32 against 30 MB in its file's Q8_0."""

    __slots__ = ("weight",)

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return qgemv.load().embed(w.data, w.type_name, w.k, ids, tiled=w.tiled)


def quantized_methods(layer, weights: dict[str, QuantWeight | torch.Tensor],
                      norm: Callable = rms_norm, rope: Callable = apply_rope,
                      int_rows: float | None = INT_ROWS) -> LayerMethods:
    """A DecoderLayer's methods with `weights` (attribute name -> QuantWeight, or the float
    tensor of a projection the loader kept dense) as block.dense_methods lays them out."""
    from kvserve.layers.linear import Dense, DenseGated

    def linear(name: str, bias: torch.Tensor | None) -> LinearMethod:
        w = weights[name]
        quantized = isinstance(w, (QuantWeight, StackedQuantWeight))
        return QuantizedLinear(w, bias, int_rows) if quantized else Dense(w, bias)

    eps = layer.eps
    qkv = normed(norm, layer.input_layernorm, eps,
                 linear("qkv_proj", layer.qkv_proj.bias).apply)

    def attn_in(h: torch.Tensor, cos_sin: torch.Tensor) -> tuple:
        return split_qkv(layer, qkv(h), cos_sin, norm, rope)

    o = with_output_norm(linear("o_proj", layer.o_proj.bias), layer.attn_out_norm, eps, norm)
    gu = weights["gate_up_proj"]
    gate_up = QuantizedGated(gu, layer.gate_up_proj.bias, layer.intermediate_size, layer.gelu,
                             int_rows) if isinstance(gu, QuantWeight) \
        else DenseGated(gu, layer.gate_up_proj.bias, layer.intermediate_size, layer.gelu)
    mlp = normed(norm, layer.post_attention_layernorm, eps, gate_up.apply)
    down = with_output_norm(linear("down_proj", layer.down_proj.bias), layer.mlp_out_norm, eps,
                            norm)
    return LayerMethods(attn_in, o.apply_add, mlp, down.apply_add)
