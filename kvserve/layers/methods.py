"""How each part of a model computes, as objects a part is given when it is built: a decoder
layer's `DecoderMethod`, the LM head's `HeadMethod`, the token lookup's `Embedding`, and
`Projection` (the method of one projection module of an architecture's own layers,
DeepSeek's). Kernel-free: the dense
methods (F.linear, torch's element-wise ops, or the ones a `MethodSource` passes in, the GPU's
Triton kernels) and tensor parallelism's wrappers live here; the CPU's measured and quantized
methods beside them (`kvserve.layers.cpu_methods`) subclass these.

Why objects fixed at construction and `prepare`d after loading (vLLM's
`process_weights_after_loading`): which kernel runs is decided before the model exists (the
`ExecutionPlan`), but a packed or quantized weight can only be made from the loaded one. So a
method is chosen once, by the layer's constructor, and makes what it runs from the layer's
weights in `prepare`; nothing outside a layer assigns its methods afterwards
(tests/test_model_shape.py walks the modules to check).

Tensor parallelism (`ReducedDecoder`, `GatheredHead`, `VocabParallelEmbedding`, `Reduced`):
column-parallel projections (qkv, gate | up) need nothing, each rank computes its own heads or
MLP columns; row-parallel ones (o, down) hold columns, so each rank's product is a partial
sum that `Reduced` all-reduces before the bias, the output norm and the residual add. The
embedding is vocabulary-parallel (each rank looks up the ids in its rows, zeros elsewhere, one
all-reduce), and so is the LM head (each rank its vocabulary's logits, gathered side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.layers.block import LayerMethods, dense_methods
from kvserve.layers.buckets import NUM_BUCKETS
from kvserve.layers.linear import Dense, DenseGated, LinearMethod
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope


# -- a decoder layer ------------------------------------------------------------------------
@dataclass
class Packed:
    """What a method's packed kernels (oneDNN, the panel GEMM) hold, which no parameter shows:
    the weights held only in a packed layout (`bytes`, `values`: their row-major parameters
    were freed) and the packed copies held beside a row-major tensor that stays (`copies`:
    a tied head's copy of the embedding table). Why: the start-up line counted parameters,
    so a BF16 model packed for oneDNN said 201.5 MB of weights for 2.3 GB held."""
    bytes: int = 0
    values: int = 0
    copies: int = 0

    def add(self, weight: torch.Tensor, packs: int, kept: bool) -> None:
        """`weight` packed `packs` times; `kept`: its row-major tensor stays too."""
        if packs == 0:
            return
        nbytes = weight.numel() * weight.element_size()
        if not kept:
            self.bytes += nbytes
            self.values += weight.numel()
        self.copies += (packs - (not kept)) * nbytes


class DecoderMethod:
    """How one DecoderLayer runs: one `LayerMethods` per row bucket (`buckets`), the rows per
    chunk of a long prefill's MLP (`mlp_chunk_rows`, None: unchunked), and the layer as bound
    C++ ops for the one-call decode step (`one_call_ops`, where this method has them)."""

    kernels = "dense"  # what the GEMM plan's description calls this method's projections

    def __init__(self) -> None:
        self.buckets: list[LayerMethods] = []
        self.mlp_chunk_rows: int | None = None
        self.one_call_ops: tuple | None = None
        self.packed = Packed()  # the weight bytes its packed kernels hold (weight_bytes reads)

    def prepare(self, layer) -> None:
        """Make what this method runs from `layer`'s loaded weights (once)."""
        raise NotImplementedError


class DenseDecoder(DecoderMethod):
    """`Dense` projections on the row-major weights with `norm`, `rope` and the gated
    activation `act` ([T, 2i] -> [T, i]; None: SiLU or GELU-tanh in torch) around them."""

    def __init__(self, norm: Callable = rms_norm, rope: Callable = apply_rope,
                 act: Callable | None = None) -> None:
        super().__init__()
        self.norm, self.rope, self.act = norm, rope, act

    def prepare(self, layer) -> None:
        gate_up = None
        if self.act is not None and not layer.gelu and layer.gate_up_proj is not None:
            gate_up = DenseGated(layer.gate_up_proj.weight, layer.gate_up_proj.bias,
                                 layer.intermediate_size, layer.gelu, act=self.act)
        self.buckets = [dense_methods(layer, self.norm, self.rope, gate_up)] * NUM_BUCKETS


class ReducedDecoder(DecoderMethod):
    """A tensor-parallel rank's layer: `inner`'s qkv and MLP (its kernels, on this rank's
    rows), o and down all-reduced before their residual adds. No MLP chunking (its rows would
    depend on the rank's width, and every rank must run the same number of all-reduces) and
    no one-call decode (it has no all-reduce)."""

    def __init__(self, inner: DecoderMethod, comm: Any) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm
        self.kernels = inner.kernels

    def prepare(self, layer) -> None:
        self.inner.prepare(layer)
        o = Reduced(layer.o_proj.weight, layer.o_proj.bias, self.comm)
        d = layer.down_proj  # (None in a routed-experts layer: they all-reduce their own sum)
        down = None if d is None else Reduced(d.weight, d.bias, self.comm)
        reduced = dense_methods(layer, o=o, down=down)  # (its adds, output-normed; routed
        # experts all-reduce their own sum)
        self.buckets = [LayerMethods(m.attn_in, reduced.o_add, m.mlp, reduced.down_add)
                        for m in self.inner.buckets]


# -- the LM head ----------------------------------------------------------------------------
class HeadMethod:
    """The LM head's `LinearMethod` per row bucket (`buckets`) and the kernel each runs
    (`kernels`, for the GEMM plan's description)."""

    def __init__(self) -> None:
        self.buckets: list[LinearMethod] = []
        self.kernels: list[str] = ["dense"] * NUM_BUCKETS
        self.packed = Packed()

    def prepare(self, model) -> None:
        raise NotImplementedError


class DenseHead(HeadMethod):
    def prepare(self, model) -> None:
        self.buckets = [Dense(model.head_weight())] * NUM_BUCKETS


class GatheredHead(HeadMethod):
    """The vocabulary-parallel LM head: this rank's logits (`inner`'s), then every rank's
    side by side."""

    def __init__(self, inner: HeadMethod, comm: Any, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.inner, self.comm, self.sizes = inner, comm, list(sizes)

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.kernels = self.inner.kernels
        self.buckets = [_Gathered(m, self.comm, self.sizes) for m in self.inner.buckets]


class _Gathered(LinearMethod):
    __slots__ = ("inner", "comm", "sizes")

    def __init__(self, inner: LinearMethod, comm: Any, sizes: list[int]) -> None:
        self.inner, self.comm, self.sizes = inner, comm, sizes

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(self.inner.apply(x), self.sizes)


# -- the token embedding --------------------------------------------------------------------
class Embedding:
    """ids [T] -> rows of the table [T, hidden]."""

    def prepare(self, model) -> None:
        raise NotImplementedError

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseEmbedding(Embedding):
    def __init__(self) -> None:
        self.table: torch.Tensor | None = None

    def prepare(self, model) -> None:
        self.table = model.embed_tokens.weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)


class VocabParallelEmbedding(Embedding):
    """ids -> rows of the table this rank holds ([start, start + rows) of the vocabulary),
    zeros for the others' ids, summed over ranks."""

    def __init__(self, start: int, comm: Any) -> None:
        self.start, self.comm = start, comm
        self.table: torch.Tensor | None = None

    def prepare(self, model) -> None:
        self.table = model.embed_tokens.weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.table.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.table)
        return self.comm.all_reduce(rows.masked_fill_(outside[:, None], 0))


# -- single projections (an architecture's own layers) --------------------------------------
class Reduced(LinearMethod):
    """A row-parallel projection: all_reduce(x W_r^T) + b (b on every rank: it is replicated
    and added after the sum)."""

    __slots__ = ("weight", "bias", "comm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Any) -> None:
        self.weight, self.bias, self.comm = weight, bias, comm

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual.add_(self.apply(x))


class Projection(LinearMethod):
    """One projection module's method (`linear`, a `projection.Linear`), fixed at
    construction and made in `prepare`: Dense here, all-reduced (`Reduced`) with `comm` (a
    row-parallel projection of a tensor-parallel rank); the CPU's packed variant is
    `cpu_methods.PackedProjection`."""

    __slots__ = ("linear", "comm", "inner")

    def __init__(self, linear: torch.nn.Module, comm: Any = None) -> None:
        self.linear, self.comm = linear, comm
        self.inner: LinearMethod | None = None

    def prepare(self) -> None:
        w = self.linear.weight
        self.inner = Dense(w) if self.comm is None else Reduced(w, None, self.comm)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(x)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.inner.apply_add(x, residual)
