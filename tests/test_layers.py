"""The layers' method objects (kvserve/layers/linear.py, cpu_linear.py): every kernel a
projection can be bound to computes the same x W^T + b (`apply`) and residual + x W^T + b
(`apply_add`), so the GEMM plan may bind any of them without the model noticing; and a layer
runs the methods it holds (kvserve/layers/selection.py binds them, per row bucket)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import gemv, panel_gemm
from kvserve.layers.activation import gated
from kvserve.layers.buckets import BUCKETS, NUM_BUCKETS, bucket_of
from kvserve.layers.cpu_linear import (Gemv, OneDNN, OneDNNGated, Panel, gemv_available,
                                       onednn_available, onednn_pack)
from kvserve.layers.linear import Dense, DenseGated, OutputNormed, with_output_norm
from kvserve.layers.norm import rms_norm

CPU = torch.device("cpu")
F32 = torch.float32


def _methods(w: torch.Tensor, b: torch.Tensor) -> dict:
    """kernel -> (apply method, apply_add method) on weight w, bias b, where it runs here."""
    out = {"dense": (Dense(w, b), Dense(w, b))}
    if onednn_available(F32, CPU):
        packed = onednn_pack(w)
        out["onednn"] = (OneDNN(packed, b), OneDNN(packed, b))
    if gemv_available(F32, CPU):
        g = gemv.load()
        out["gemv"] = (Gemv(g.bind(w, b)), Gemv(g.bind(w, b, gemv.MODE_ADD)))
    if panel_gemm.available(F32, CPU):
        g = panel_gemm.load()
        m = Panel(g.bind(g.pack(w), b))
        out["panel"] = (m, m)
    return out


@pytest.mark.parametrize("rows", [1, 3, 17, 70])
def test_every_linear_method_computes_the_same_projection(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    r = torch.randn(rows, 96, generator=gen)
    want = F.linear(x, w, b)
    for kernel, (plain, adding) in _methods(w, b).items():
        if kernel == "gemv" and rows > gemv.MAX_ROWS:
            continue  # offered for the first bucket only
        torch.testing.assert_close(plain.apply(x), want, rtol=1e-4, atol=1e-4, msg=kernel)
        torch.testing.assert_close(adding.apply_add(x, r.clone()), r + want, rtol=1e-4,
                                   atol=1e-4, msg=kernel)


def test_the_gated_methods_and_the_output_norm():
    gen = torch.Generator().manual_seed(3)
    i, k = 40, 32
    w = torch.randn(2 * i, k, generator=gen)
    b = torch.randn(2 * i, generator=gen)
    x = torch.randn(5, k, generator=gen)
    for gelu in (False, True):
        want = gated(F.linear(x, w, b), i, gelu)
        torch.testing.assert_close(DenseGated(w, b, i, gelu).apply(x), want)
        if onednn_available(F32, CPU):
            torch.testing.assert_close(OneDNNGated(w, b, i, gelu).apply(x), want, rtol=1e-4,
                                       atol=1e-4)
    # Gemma's output norms: residual + norm(x W^T + b), the add after the norm
    wo, n, r = torch.randn(k, k, generator=gen), torch.rand(k, generator=gen), torch.randn(5, k)
    normed = with_output_norm(Dense(wo), n, 1e-6)
    assert isinstance(normed, OutputNormed)
    assert isinstance(with_output_norm(Dense(wo), None, 1e-6), Dense)  # no norm: no wrapper
    torch.testing.assert_close(normed.apply_add(x, r.clone()),
                               r + rms_norm(F.linear(x, wo), n, 1e-6))


def test_buckets_cover_every_row_count():
    assert NUM_BUCKETS == len(BUCKETS)
    assert [bucket_of(t) for t in (1, 4, 5, 32, 33, 128, 129, 512, 513, 10 ** 6)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_layer_runs_the_methods_it_holds():
    """DecoderLayer.forward calls its bucket's LayerMethods and nothing else: the methods a
    plan's source gives the layer when it is built are what runs (how the CPU's measured and
    quantized kernels and the GPU's Triton ops get in: kvserve/layers/plan.py)."""
    from kvserve.layers.block import LayerMethods
    from kvserve.layers.methods import DecoderMethod
    from kvserve.layers.plan import ExecutionPlan, MethodSource
    from kvserve.models.config import ModelConfig
    from kvserve.models.decoder import DecoderLayer

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=1e4)
    calls = []

    def attn_in(h, cs):
        calls.append("attn_in")
        t = h.shape[0]
        return torch.zeros(t, 2, 8), torch.zeros(t, 1, 8), torch.zeros(t, 1, 8)

    def o_add(o, h):
        calls.append("o_add")
        return h

    def mlp(h):
        calls.append("mlp")
        return torch.zeros(h.shape[0], 32)

    def down_add(m, h):
        calls.append("down_add")
        return h.add_(1)

    class Recorded(DecoderMethod):
        def prepare(self, layer) -> None:
            self.buckets = [LayerMethods(attn_in, o_add, mlp, down_add)] * NUM_BUCKETS

    class Source(MethodSource):
        def decoder_method(self, config):
            return Recorded()

    layer = DecoderLayer(config, 0, ExecutionPlan(torch.device("cpu"), F32, Source()))
    layer.process_weights_after_loading()
    out = layer(torch.zeros(3, 16), torch.zeros(3, 8), lambda i, q, k, v: q, bucket_of(3))
    assert calls == ["attn_in", "o_add", "mlp", "down_add"]
    assert torch.equal(out, torch.ones(3, 16))
