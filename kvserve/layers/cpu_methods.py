"""The CPU's methods (`CpuMethods`, a `plan.MethodSource`): the measured GEMM plan's kernels per
row bucket (`PlannedDecoder`, `PlannedHead`: oneDNN, the panel GEMM, the GEMV, F.linear), the
quantized weights' (`QuantizedDecoder`, `QuantizedHead`, `QuantizedEmbeddingMethod`: a GGUF
file's blocks, or a float checkpoint's quantized at load), oneDNN-packed single projections
(`PackedProjection`, DeepSeek's layers) and the decode steps that run every layer in one C++
call (`FastDecodeStep` on the GEMV, `QuantDecodeStep` on blocks).

Each is chosen by a layer's constructor from the plan and makes its kernels' weight layouts
from the loaded weights in `prepare` (packed copies made, dense ones no bucket reads freed).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kvserve.kernels.cpu import gemv, panel_gemm, qgemv
from kvserve.layers import gemm_select
from kvserve.layers import methods as m
from kvserve.layers.block import PROJECTION_ATTRS, LayerMethods, dense_methods
from kvserve.layers.block import PROJECTIONS as _PROJS
from kvserve.layers.buckets import NUM_BUCKETS
from kvserve.layers.cpu_layer_ops import kernel_ops, wrap_unfused
from kvserve.layers.cpu_linear import Gemv, OneDNN, Panel, gemv_available, onednn_pack
from kvserve.layers.fast_decode import FastDecode
from kvserve.layers.gemm_select import GemmPlan
from kvserve.layers.linear import Dense
from kvserve.layers.norm import rms_norm
from kvserve.layers.plan import MethodSource
from kvserve.layers.quant_decode import QuantDecode, cpp_rope
from kvserve.layers.quant_linear import (QuantizedEmbedding, QuantizedLinear, QuantWeight,
                                        StackedQuantWeight, kept_as_blocks, quantized_methods)
from kvserve.layers.quantize_at_load import AtLoad
from kvserve.layers.rotary import apply_rope

logger = logging.getLogger("kvserve")

MLP_CHUNK_BYTES = 16 << 20  # gate/up activations of one chunk of a long prefill's MLP
MLP_CHUNK_MIN_ROWS = 256


def mlp_chunk_rows(intermediate_size: int, element_size: int) -> int:
    """Rows per chunk of a long prefill's MLP on the CPU: the gate/up activations ([rows,
    2 x intermediate]) of one chunk stay near MLP_CHUNK_BYTES, at least MLP_CHUNK_MIN_ROWS
    rows (the GEMMs' efficiency), a multiple of 64.

    Why: the MLP of a whole 8,192-token step wrote and re-read 92 MB of gate/up activations
    (the reference model) that no cache held. Measured per row, 2 threads: MKL + SwiGLU
    ~9.6 us at 1,000-2,000 rows, 12.5 at 3,000, 14.3 at 8,192 (oneDNN 9.9 -> 13.0); the
    rows are independent, so chunks change no result."""
    rows = MLP_CHUNK_BYTES // max(1, 2 * intermediate_size * element_size)
    return max(MLP_CHUNK_MIN_ROWS, rows // 64 * 64)


def file_weight(blocks) -> QuantWeight | StackedQuantWeight:
    """A file's blocks (`quant_formats.FileBlocks`) in the layout their kernel choice gives
    them (`QuantWeight.for_kernels`: kernel_choice.choose per part)."""
    weights = [QuantWeight.for_kernels(data, type_name, blocks.k)
               for type_name, data in blocks.parts]
    return weights[0] if len(weights) == 1 else StackedQuantWeight(tuple(weights))


# -- the measured GEMM plan -----------------------------------------------------------------
class PlannedDecoder(m.DecoderMethod):
    """`plan`'s kernel per projection and row bucket. Packs (oneDNN, panel) the weights some
    bucket runs through a packed kernel and frees the dense ones no bucket uses; where the
    first bucket runs everything on the GEMV, keeps the layer as bound C++ ops
    (`one_call_ops`: the qkv GEMV with its norm and RoPE, the MLP block) for FastDecode.
    Gate and up are packed apart for oneDNN (`OneDNNGated`): SiLU then runs as the gate
    GEMM's epilogue and the product as the up GEMM's."""

    kernels = "planned"

    def __init__(self, plan: GemmPlan) -> None:
        super().__init__()
        self.plan = plan

    def prepare(self, layer) -> None:
        plan = self.plan
        built = {k: kernel_ops(layer, k, tuple(p for p in _PROJS if plan.uses(p, k)), fused=True)
                 for k in gemm_select.KERNELS}
        for kernel, ops in built.items():
            wrap_unfused(layer, kernel, ops)
        self.mlp_chunk_rows = mlp_chunk_rows(layer.intermediate_size,
                                             layer.o_proj.weight.element_size())
        block = None
        for b in range(NUM_BUCKETS):
            ops = {p: built[plan.kernels[p][b]][p] for p in _PROJS}
            fused = None
            if all(plan.kernels[p][b] == "gemv" for p in ("o", "mlp", "down")) \
                    and layer.attn_out_norm is None and layer.mlp_out_norm is None \
                    and layer.post_attention_layernorm is not None:
                o, gu, d = layer.o_proj, layer.gate_up_proj, layer.down_proj
                block = block or gemv.load().bind_mlp_block(
                    o.weight, o.bias, layer.post_attention_layernorm, layer.eps, gu.weight,
                    gu.bias, d.weight, d.bias, layer.gelu)
                fused = block
            self.buckets.append(LayerMethods(ops["qkv"], ops["o"], ops["mlp"], ops["down"],
                                             fused))
            if b == 0 and fused is not None and plan.kernels["qkv"][0] == "gemv" \
                    and layer.qk_norm is None and layer.input_layernorm is not None:
                self.one_call_ops = (gemv.load().bind(
                    layer.qkv_proj.weight, layer.qkv_proj.bias, norm_weight=layer.input_layernorm,
                    eps=layer.eps, rope_cols=layer.qk_size, head_dim=layer.head_dim), fused)
        # free the dense weights no bucket reads (the methods hold what they need)
        for proj, name in (("qkv", "qkv_proj"), ("o", "o_proj"), ("mlp", "gate_up_proj"),
                           ("down", "down_proj")):
            kept = any(plan.uses(proj, k) for k in gemm_select.ROW_MAJOR)
            projection = getattr(layer, name)
            self.packed.add(projection.weight, _packs(plan, proj), kept)
            if not kept:
                projection.release()


class PlannedHead(m.HeadMethod):
    """The LM head on `plan`'s kernel per bucket. With tied embeddings a oneDNN or panel head
    packs a copy of the table; an untied head's row-major weight is freed where no bucket
    reads it."""

    def __init__(self, plan: GemmPlan) -> None:
        super().__init__()
        self.plan = plan
        self.kernels = list(plan.kernels["head"])

    def prepare(self, model) -> None:
        plan = self.plan
        dense = model.head_weight()
        packed = onednn_pack(dense) if plan.uses("head", "onednn") else None
        by_kernel = {"onednn": OneDNN(packed) if packed is not None else None,
                     "dense": Dense(dense),
                     "gemv": Gemv(gemv.load().bind(dense)) if plan.uses("head", "gemv")
                     else None,
                     "panel": Panel(panel_gemm.load().bind(panel_gemm.load().pack(dense)))
                     if plan.uses("head", "panel") else None}
        self.buckets = [by_kernel[k] for k in plan.kernels["head"]]
        row_major = any(plan.uses("head", k) for k in gemm_select.ROW_MAJOR)
        # a tied head's table stays for the lookups: its packed layouts are copies
        self.packed.add(dense, _packs(plan, "head"), row_major or model.lm_head is None)
        if model.lm_head is not None and not row_major:
            model.lm_head.release()  # the packed copy is the head now


def _packs(plan: GemmPlan, proj: str) -> int:
    """How many packed layouts (oneDNN's, the panel GEMM's) of `proj`'s weight the plan
    makes."""
    return sum(plan.uses(proj, k) for k in gemm_select.KERNELS
               if k not in gemm_select.ROW_MAJOR)


# -- quantized weights (issue 31) -----------------------------------------------------------
class QuantizedDecoder(m.DecoderMethod):
    """The quantized linear methods (kvserve/layers/quant_linear.py) on the projections the
    loader handed over as blocks (each projection's `file_blocks`) or `at_load` quantizes; a
    projection
    left float runs F.linear, and a layer without blocks the dense methods. The norm and RoPE
    are the C++ ones the one-call step (QuantDecode) runs, so both give the same bits."""

    kernels = "quant"

    def __init__(self, at_load: AtLoad | None, cpp: bool) -> None:
        super().__init__()
        self.at_load, self.cpp = at_load, cpp
        self.weights: dict[str, QuantWeight | StackedQuantWeight] = {}

    def prepare(self, layer) -> None:
        projections = {a: getattr(layer, a) for a in PROJECTION_ATTRS}
        self.weights.update({a: file_weight(p.file_blocks) for a, p in projections.items()
                             if p is not None and p.file_blocks is not None})
        if self.at_load is not None:
            self.weights.update(self.at_load.quantize(layer))
        if not self.weights:
            self.buckets = [dense_methods(layer)] * NUM_BUCKETS
            return
        norm = gemv.load().rms_norm if self.cpp and layer.qk_norm is None else rms_norm
        weights = {a: self.weights.get(a, getattr(layer, a).weight) for a in PROJECTION_ATTRS}
        rope = cpp_rope if self.cpp else apply_rope
        self.buckets = [quantized_methods(layer, weights, norm, rope)] * NUM_BUCKETS
        self.mlp_chunk_rows = mlp_chunk_rows(layer.intermediate_size, 4)


class QuantizedEmbeddingMethod(m.Embedding):
    """Lookups read the table's blocks where the loader kept it quantized (`weight`), else
    the float table."""

    def __init__(self) -> None:
        self.weight: QuantWeight | None = None
        self._fn = None

    def prepare(self, model) -> None:
        blocks = model.embed_tokens.file_blocks
        if blocks is not None:
            self.weight = file_weight(blocks)
            self._fn = QuantizedEmbedding(self.weight)
        else:  # the float table, as the dense method reads it
            self._fn = m.DenseEmbedding()
            self._fn.prepare(model)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self._fn(ids)


class QuantizedHead(m.HeadMethod):
    """At the first row bucket the head runs its Q8_0 table (the file's, where it has one)
    with x kept in float32 (the float table, else the GEMV, above it): the integer kernel
    there, x quantized to 8 bits, changed the demo's answer ("What is the capital of France?"
    no longer began "The capital of France is Paris"), the final norm's outliers setting each
    block's scale. Where the table is kept quantized and tied, or untied in a type other than
    Q8_0, the head runs its blocks at every bucket (no float table is left): x in float32 on
    Q8_0, the integer kernel on the other types (no float-x path for them yet; a
    projection-sized error, bounded by tests/test_quant_kquants.py)."""

    def __init__(self, cpp: bool) -> None:
        super().__init__()
        self.cpp = cpp
        self.weight: QuantWeight | None = None

    def prepare(self, model) -> None:
        embed = getattr(model.embed, "weight", None)
        blocks = model.lm_head.file_blocks if model.lm_head is not None else None
        if embed is not None and model.lm_head is None:
            self.weight = embed
        elif blocks is not None:
            self.weight = file_weight(blocks)
        head = model.head_weight()
        self.buckets = [Dense(head)] * NUM_BUCKETS
        self.kernels = ["dense"] * NUM_BUCKETS
        if self.weight is not None and head is None:  # the blocks alone, tied or not
            fx = self.weight.type_name == "Q8_0"
            self.buckets = [QuantizedLinear(self.weight, None, float("inf"), float_x=fx)
                            ] * NUM_BUCKETS
            self.kernels = ["quant-fx" if fx else "quant"] * NUM_BUCKETS
        elif self.weight is not None:  # Q8_0, x in float: 0.9 ms at batch 1 against fp32's 2.2
            self.buckets[0] = QuantizedLinear(self.weight, None, float("inf"), float_x=True)
            self.kernels[0] = "quant-fx"
        elif self.cpp:  # the float GEMV at a few rows, as a measured plan has it on most CPUs
            self.buckets[0] = Gemv(gemv.load().bind(head))
            self.kernels[0] = "gemv"
        kernel = qgemv.load()
        logger.info("quantized projections (%s kernel): %s",
                    kernel.isa if kernel is not None else "none", model.gemm_plan.describe())


# -- single projections and the one-call decode steps ---------------------------------------
class PackedProjection(m.Projection):
    """oneDNN on a packed copy of the projection's weight (which the copy replaces, through
    the projection's own `replace`)."""

    __slots__ = ()

    def prepare(self) -> None:
        self.linear.replace(onednn_pack(self.linear.weight))
        self.inner = OneDNN(self.linear.weight)


class FastDecodeStep:
    """FastDecode (kvserve/layers/fast_decode.py) over the layers' `one_call_ops`, made once
    they are prepared; `run` returns None for a step it does not serve."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.impl: FastDecode | None = None

    def prepare(self, model) -> None:
        ops = [getattr(layer.method, "one_call_ops", None) for layer in model.layers]
        if ops and all(op is not None for op in ops):
            c = self.config
            self.impl = FastDecode(ops, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim)

    @property
    def max_rows(self) -> int | None:
        """The most rows a step it serves has (None: it serves none), decided at load with
        the layers' kernel choices (the rows their integer kernel / GEMV runs)."""
        return None if self.impl is None or self.impl.max_rows < 1 else self.impl.max_rows

    def serves(self, rows: int) -> bool:
        """Whether a step of `rows` rows is one for this step's kernels (the forward's
        question; the attention backend may still have no kernel arguments for the step,
        a quantized KV cache's, and `run` then returns None)."""
        limit = self.max_rows
        return limit is not None and 0 < rows <= limit

    def run(self, hidden: torch.Tensor, cos_sin: torch.Tensor, attn: object):
        return None if self.impl is None else self.impl.run(hidden, cos_sin, attn)


class QuantDecodeStep(FastDecodeStep):
    """QuantDecode where every layer's projections are blocks (`QuantDecode.build`)."""

    def prepare(self, model) -> None:
        self.impl = QuantDecode.build(model)


# -- the source -----------------------------------------------------------------------------
class CpuMethods(MethodSource):
    """The CPU's methods for a float model run on `gemm` (a measured or forced GemmPlan), or
    a quantized one (`quantization`: "gguf", a file's blocks where the kernels run them, or an
    at-load format). The norm around the kernels is the C++ one where it builds (float32)."""

    def __init__(self, dtype: torch.dtype, gemm: GemmPlan | None = None,
                 quantization: str = "none", num_layers: int = 0) -> None:
        self.cpp = gemv_available(dtype, torch.device("cpu"))
        super().__init__(norm=gemv.load().rms_norm if self.cpp else rms_norm)
        self.gemm, self.quantization = gemm, quantization
        self.keeps_blocks = quantization == "gguf"
        self.at_load = None if quantization in ("none", "gguf") \
            else AtLoad(quantization, num_layers)

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"

    def decoder_method(self, config) -> m.DecoderMethod:
        if self.quantized:
            return QuantizedDecoder(self.at_load, self.cpp)
        if self.gemm is not None and config.moe is None:
            return PlannedDecoder(self.gemm)
        return m.DenseDecoder()  # (routed experts: F.linear, as DeepSeek's run)

    def head_method(self, config) -> m.HeadMethod:
        if self.quantized:
            return QuantizedHead(self.cpp)
        return PlannedHead(self.gemm) if self.gemm is not None else m.DenseHead()

    def embedding(self, config) -> m.Embedding:
        return QuantizedEmbeddingMethod() if self.quantized else m.DenseEmbedding()

    def projection(self, linear: nn.Module, comm: Any = None) -> m.Projection:
        if comm is None and self.gemm is not None and mla_kernel(self.gemm) == "onednn":
            return PackedProjection(linear)
        return m.Projection(linear, comm)

    def one_call_decode(self, config) -> Any:
        """A one-call step where the layers can have one: pre-norms and nothing else around
        the projections (no q/k norms, no output norms), one RoPE, no MLA / MoE layers; on
        blocks, or on a plan whose first bucket runs every projection on the GEMV. (Whether
        every layer's weights then allow it, `prepare` finds out.)"""
        if config.mla is not None or config.moe is not None or config.qk_norm \
                or config.output_norms or not config.pre_norms or not config.one_rope:
            return None
        if self.quantized:
            return QuantDecodeStep(config) if self.cpp else None
        if self.gemm is None or not all(self.gemm.kernels[p][0] == "gemv" for p in _PROJS):
            return None
        return FastDecodeStep(config)

    def accepts_blocks(self, attr: str, type_names: tuple[str, ...] | set[str], k: int) -> bool:
        """Whether a GGUF weight of these block types and width stays blocks: a DecoderLayer
        projection (PROJECTION_ATTRS) the kernels run, or the embedding table / LM head
        ("embed_tokens", "lm_head": one type)."""
        if not self.keeps_blocks:
            return False
        if attr in PROJECTION_ATTRS:
            return kept_as_blocks(attr, type_names, k)
        return len(set(type_names)) == 1 and all(qgemv.fits(t, k) for t in type_names)

    def describe(self, model) -> GemmPlan | None:
        if self.quantized:
            return GemmPlan({**{p: ["quant"] * NUM_BUCKETS for p in _PROJS},
                             "head": list(model.head.kernels)}, "quantized")
        return self.gemm


def mla_kernel(plan: GemmPlan) -> str:
    """The one kernel DeepSeek's layers run for every projection and bucket (the per-bucket
    choice is measured on DecoderLayer's projections, not MLA's or MoE's); the C++ GEMV and
    panel GEMM are not wired into MLA / MoE, so those buckets stay dense."""
    kernels = {"dense" if k in ("gemv", "panel") else k for p in _PROJS
               for k in plan.kernels[p]}
    if len(kernels) != 1:
        raise ValueError("DeepSeek layers run one GEMM kernel for every projection and "
                         f"batch size; the plan mixes {sorted(kernels)}")
    return kernels.pop()
