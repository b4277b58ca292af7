"""How a model will compute, decided before it is built: the `ExecutionPlan` every model and
layer constructor receives (device, dtype, where its methods come from, the tensor-parallel
rank), and `MethodSource`, the methods one platform offers.

A constructor asks the plan for its method (`plan.decoder_method(config)`, `head_method`,
`embedding`, `projection`, `final_norm`, `one_call_decode`) and keeps what it gets: the model
code never imports a kernel, and no binder patches a finished model (what vLLM's
`LinearBase.quant_method` is to its layers). `MethodSource` here is the dense one (F.linear
and torch's element-wise ops, or the GPU's Triton norm, RoPE and SiLU-and-mul passed in);
the CPU's (`kvserve.layers.cpu_methods.CpuMethods`: the measured GEMM plan, GGUF blocks,
quantize-at-load, the one-call decode steps) subclasses it. `kvserve.layers.selection.plan_for`
makes the plan a load asks for. Kernel-free, so that the model code may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.layers import methods as m
from kvserve.layers.norm import rms_norm
from kvserve.layers.rotary import apply_rope


@dataclass(frozen=True)
class TensorParallel:
    """A rank's part: `comm` (all_reduce(t), all_gather_last(t, sizes)), the first vocabulary
    row it holds and every rank's vocabulary rows."""

    comm: Any
    vocab_start: int
    vocab_sizes: tuple[int, ...]


class MethodSource:
    """The dense methods, with `norm`, `rope` and the gated activation `act` of a platform
    (torch's by default; the GPU's Triton kernels). A subclass overrides what it runs
    otherwise; each call makes a new method object (a layer's own)."""

    def __init__(self, norm: Callable = rms_norm, rope: Callable = apply_rope,
                 act: Callable | None = None) -> None:
        self.norm, self.rope, self.act = norm, rope, act

    def decoder_method(self, config) -> m.DecoderMethod:
        return m.DenseDecoder(self.norm, self.rope, self.act)

    def head_method(self, config) -> m.HeadMethod:
        return m.DenseHead()

    def embedding(self, config) -> m.Embedding:
        return m.DenseEmbedding()

    def projection(self, linear: torch.nn.Module, comm: Any = None) -> m.Projection:
        return m.Projection(linear, comm)

    def final_norm(self) -> Callable:
        return self.norm

    def one_call_decode(self, config) -> Any:
        """The decode step that runs every layer in one call, or None (dense: none)."""
        return None

    # whether a GGUF file's block-format weights stay blocks (`accepts_blocks` says which)
    keeps_blocks = False

    def accepts_blocks(self, attr: str, type_names: Any, k: int) -> bool:
        """Whether the loader hands weight `attr` (a DecoderLayer projection attribute,
        "embed_tokens" or "lm_head") over as its file's blocks of these types, width k."""
        return False

    def describe(self, model) -> Any:
        """The GEMM plan this source runs `model` with (`CausalLM.gemm_plan`), or None."""
        return None


@dataclass(frozen=True)
class ExecutionPlan:
    """What a model's constructor needs to build parts that know how to compute."""

    device: torch.device
    dtype: torch.dtype
    source: MethodSource = field(default_factory=MethodSource)
    tp: TensorParallel | None = None

    @classmethod
    def dense(cls, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = "cpu") -> "ExecutionPlan":
        """F.linear and torch ops: a model for reading shapes ("meta") or checking numbers."""
        return cls(torch.device(device if device is not None else "cpu"), dtype)

    def decoder_method(self, config) -> m.DecoderMethod:
        inner = self.source.decoder_method(config)
        return inner if self.tp is None else m.ReducedDecoder(inner, self.tp.comm)

    def head_method(self, config) -> m.HeadMethod:
        inner = self.source.head_method(config)
        if self.tp is None:
            return inner
        return m.GatheredHead(inner, self.tp.comm, self.tp.vocab_sizes)

    def embedding(self, config) -> m.Embedding:
        if self.tp is not None:
            return m.VocabParallelEmbedding(self.tp.vocab_start, self.tp.comm)
        return self.source.embedding(config)

    def projection(self, linear: torch.nn.Module, row: bool = False) -> m.Projection:
        """The method of `linear` (a `projection.Linear`); `row`: a row-parallel projection
        (all-reduced on a rank)."""
        comm = self.tp.comm if row and self.tp is not None else None
        return self.source.projection(linear, comm)

    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A rank's all-reduce (for partial sums a layer adds itself: MoE), or None."""
        return None if self.tp is None else self.tp.comm.all_reduce

    def final_norm(self) -> Callable:
        return self.source.final_norm()

    def one_call_decode(self, config) -> Any:
        return None if self.tp is not None else self.source.one_call_decode(config)
