"""The sharded model's methods: what turns one rank's ordinary, smaller model into its part of
the whole one.

Column-parallel projections (qkv, gate | up, MLA's q_b and kv_b) need nothing: each rank holds
its rows and computes its own heads or MLP columns. Row-parallel ones (o, down, each expert's
down) hold columns, so each rank's product is a partial sum: `Reduced` all-reduces it before the
bias, the output norm (Gemma 3) and the residual add, so one all-reduce per projection and the
residual stream stays identical on every rank. The embedding is vocabulary-parallel (each rank
looks up the ids in its rows, zeros elsewhere, one all-reduce) and so is the LM head (each rank
its vocabulary's logits, gathered side by side). DeepSeek's MoE all-reduces once, after the
routed and shared experts' partial sums are added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.layers.block import dense_methods
from kvserve.layers.buckets import NUM_BUCKETS
from kvserve.layers.linear import Dense, LinearMethod
from kvserve.parallel.comm import Comm
from kvserve.model_loader.tp_layout import RankLayout


class Reduced(LinearMethod):
    """A row-parallel projection: all_reduce(x W_r^T) + b (b on every rank: it is replicated
    and added after the sum)."""

    __slots__ = ("weight", "bias", "comm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> None:
        self.weight, self.bias, self.comm = weight, bias, comm

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)

    def apply_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual.add_(self.apply(x))


class GatheredHead(LinearMethod):
    """The vocabulary-parallel LM head: this rank's logits, then every rank's side by side."""

    __slots__ = ("inner", "comm", "sizes")

    def __init__(self, inner: LinearMethod, comm: Comm, sizes: list[int]) -> None:
        self.inner, self.comm, self.sizes = inner, comm, sizes

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(self.inner.apply(x), self.sizes)


class VocabParallelEmbedding:
    """ids -> rows of the table this rank holds ([start, stop) of the vocabulary), zeros for
    the others' ids, summed over ranks."""

    def __init__(self, table: torch.Tensor, start: int, comm: Comm) -> None:
        self.table, self.start, self.comm = table, start, comm

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.table.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.table)
        return self.comm.all_reduce(rows.masked_fill_(outside[:, None], 0))


def pack_column_parallel(model) -> None:
    """On the CPU in float32: the measured GEMM plan (kvserve.layers.selection, on this
    rank's shapes) for the projections that need no reduction, qkv and gate | up with the
    norms, RoPE and activation around them; o, down and the head stay dense, for `Reduced`
    and `GatheredHead` to wrap."""
    from dataclasses import replace

    from kvserve.layers import selection
    from kvserve.models.decoder import DecoderLayer

    if model.embed_tokens.device.type != "cpu" or model.dtype != torch.float32 \
            or not all(isinstance(layer, DecoderLayer) for layer in model.layers):
        return
    plan = selection.measure_gemms(model)
    kernels = {p: list(ks) for p, ks in plan.kernels.items()}
    for p in ("o", "down", "head"):
        kernels[p] = ["dense"] * len(kernels[p])
    selection.apply_gemm_plan(model, replace(plan, kernels=kernels))


def bind_tensor_parallel(model, layout: RankLayout, comm: Comm, vocab_sizes: list[int]) -> None:
    """Install the sharded methods on a rank's model (loaded with `load_model(shard=...)`,
    perhaps packed by `pack_column_parallel`): o and down all-reduce before their residual
    adds, the embedding and the head are vocabulary-parallel, no one-call decode step."""
    from kvserve.models.deepseek_layers import DeepseekLayer, MoE

    model.embed_fn = VocabParallelEmbedding(model.embed_tokens, layout.vocab[0], comm)
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    model.head_methods = [GatheredHead(Dense(head), comm, vocab_sizes)] * NUM_BUCKETS
    for layer in model.layers:
        if isinstance(layer, DeepseekLayer):
            layer.o = Reduced(layer.o_proj, None, comm)
            if isinstance(layer.mlp, MoE):
                layer.mlp.reduce = comm.all_reduce
            else:
                layer.mlp.down = Reduced(layer.mlp.down_proj, None, comm)
            continue
        o = Reduced(layer.o_proj, layer.o_bias, comm)
        down = Reduced(layer.down_proj, layer.down_bias, comm)
        # No MLP chunking: its rows depend on the rank's width, and every rank must run the
        # same number of down all-reduces.
        layer.mlp_chunk_rows = None
        if model.gemm_plan is None:
            layer.methods = [dense_methods(layer, o=o, down=down)] * NUM_BUCKETS
            continue
        reduced = dense_methods(layer, o=o, down=down)  # (its o and down adds, output-normed)
        for methods in layer.methods:  # the plan's qkv and MLP, these adds
            methods.o_add, methods.down_add, methods.o_mlp = reduced.o_add, reduced.down_add, None
    model.decode_step = None  # (the one-call decode has no all-reduce)
