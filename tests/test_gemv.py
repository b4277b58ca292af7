"""The C++ small-batch GEMV (kvserve/kernels/cpu/gemv.py, csrc/gemv.cpp) against plain PyTorch.

Odd sizes (output features not a multiple of the kernel's 4-row blocks, k not a multiple of
the vector width) catch a wrong tail; strided x rows catch a wrong row stride; the fused
epilogues (bias, residual add, SiLU / GELU-tanh gate times up) are checked against the
unfused torch ops. End-to-end agreement with transformers through the kernel is
test_model_parity.py's `test_gemv_plan_matches_transformers`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers import gemm_select

from kvserve.kernels.cpu import gemv

g = gemv.load()
pytestmark = pytest.mark.skipif(g is None, reason="the C++ GEMV kernel could not be built")

SHAPES = [(1, 1), (3, 5), (7, 33), (37, 100), (256, 512), (1031, 257)]  # (n, k)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(n, k, rows, bias):
    gen = _gen(n * 1000 + k + rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    out = g.linear(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_add_accumulates_into_the_residual(n, k):
    gen = _gen(n + 7 * k)
    x, w = torch.randn(3, k, generator=gen), torch.randn(n, k, generator=gen)
    b, r = torch.randn(n, generator=gen), torch.randn(3, n, generator=gen)
    expect = r + F.linear(x, w, b)
    out = g.linear_add(x, r, w, b)
    assert out.data_ptr() == r.data_ptr()  # in place
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("i,k", [(1, 3), (5, 17), (96, 64), (353, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_matches_act_gate_times_up(gelu, i, k, bias):
    gen = _gen(i * 31 + k)
    x, w = torch.randn(4, k, generator=gen), torch.randn(2 * i, k, generator=gen)
    b = torch.randn(2 * i, generator=gen) if bias else None
    gate_up = F.linear(x, w, b)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    torch.testing.assert_close(g.gated(x, w, b, gelu), act * up, rtol=1e-5, atol=1e-4)


def test_strided_rows_and_views():
    """x may be a row-strided view (a slice of a wider activation); its columns are used as
    they are, not its backing storage."""
    gen = _gen(5)
    wide = torch.randn(4, 100, generator=gen)
    x = wide[:, 10:60]  # row stride 100
    w = torch.randn(9, 50, generator=gen)
    torch.testing.assert_close(g.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    r = torch.zeros(4, 20)[:, :9]  # residual with a row stride of 20
    torch.testing.assert_close(g.linear_add(x, r, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_refused():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="unit-strided"):
        g.linear(torch.randn(16, 2).t(), w)  # column stride 2
    with pytest.raises(ValueError, match="contiguous"):
        g.linear(torch.randn(2, 16), torch.randn(16, 8).t())
    with pytest.raises(ValueError, match="float32"):
        g.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="does not match"):
        g.linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="bias"):
        g.linear(torch.randn(2, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match="residual"):
        g.linear_add(torch.randn(2, 16), torch.randn(3, 8), w)
    with pytest.raises(ValueError, match="even"):
        g.gated(torch.randn(2, 16), torch.randn(7, 16))


def test_threads_agree():
    """Output rows are split across threads: every thread count gives the same answer."""
    gen = _gen(9)
    x, w = torch.randn(2, 300, generator=gen), torch.randn(1001, 300, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(g.linear(x, w))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_read_sum():
    t = torch.arange(1000, dtype=torch.float32)
    assert g.read_sum(t) == pytest.approx(float(t.sum()), rel=1e-6)


def test_gemm_select_offers_gemv_in_the_first_bucket_only():
    n = len(gemm_select.BUCKETS)
    none = [None] * (n - 1)
    # gemv faster at 1-4 rows: it takes that bucket beside dense, whatever the margin
    times = {"qkv": {"dense": [1.0] * n, "onednn": [2.0] * n, "gemv": [0.95] + none}}
    assert gemm_select.decide(times)["qkv"] == ["gemv"] + ["dense"] * (n - 1)
    # slower: not chosen
    times["qkv"]["gemv"] = [1.2] + none
    assert gemm_select.decide(times)["qkv"] == ["dense"] * n
    # beside oneDNN everywhere it would add the row-major layout: needs a real gain
    times = {"qkv": {"dense": [2.0] * n, "onednn": [1.0] * n, "gemv": [0.95] + none}}
    assert gemm_select.decide(times)["qkv"] == ["onednn"] * n
    times["qkv"]["gemv"] = [0.5] + none
    assert gemm_select.decide(times)["qkv"] == ["gemv"] + ["onednn"] * (n - 1)
    assert gemm_select.forced_plan("gemv").kernels["head"] == ["gemv"] + ["dense"] * (n - 1)


@pytest.mark.parametrize("qk_rope", [False, True])
def test_bound_ops_match_the_checked_ones_and_torch(qk_rope):
    """The decoder's bound ops (weights fixed once, one packed ctypes call) against plain
    torch: RMSNorm -> projection (+ bias) -> RoPE over the first heads; the residual add;
    the gated MLP with its norm."""
    gen = _gen(11)
    h, d, heads = 48, 8, 5
    w, b = torch.randn(heads * d + 8, h, generator=gen), torch.randn(heads * d + 8, generator=gen)
    ln = 1 + 0.2 * torch.randn(h, generator=gen)
    x = torch.randn(3, h, generator=gen)
    cs = torch.randn(3, d, generator=gen)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ln
    ref = F.linear(xn, w, b)
    if qk_rope:
        qk = ref[:, : heads * d].view(3, heads, d)
        x1, x2 = qk[..., : d // 2], qk[..., d // 2:]
        cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2:]
        ref[:, : heads * d] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin),
                                        -1).view(3, -1)
    op = g.bind(w, b, norm_weight=ln, eps=1e-6, rope_cols=heads * d if qk_rope else 0,
                head_dim=d)
    torch.testing.assert_close(op(x, None, cs), ref, rtol=1e-5, atol=1e-4)
    r = torch.randn(3, heads * d + 8, generator=gen)
    add = g.bind(w, b, gemv.MODE_ADD)
    torch.testing.assert_close(add(x, r.clone()), r + F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    gu = torch.randn(2 * 7, h, generator=gen)
    gate_up = F.linear(xn, gu)
    mlp = g.bind(gu, None, gemv.MODE_SILU_MUL, norm_weight=ln, eps=1e-6)
    torch.testing.assert_close(mlp(x), F.silu(gate_up[:, :7]) * gate_up[:, 7:],
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="unit stride"):
        op(torch.randn(h, 3).t(), None, cs)
    with pytest.raises(ValueError, match="float32"):
        op(torch.randn(3, h + 1), None, cs)
    with pytest.raises(ValueError, match="RoPE"):
        g.bind(w, b, rope_cols=d + 1, head_dim=d)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_norm_and_rope_match_torch(rows):
    """The element-wise kernels the MKL / oneDNN layers use around their GEMMs: RMSNorm (odd
    width, strided rows) and RoPE in place over the first heads of a wider, strided tensor,
    against the plain-torch formulas (threads share rows from 8 up)."""
    gen = _gen(rows)
    k, d, heads = 37, 8, 3
    x = torch.randn(rows, k + 5, generator=gen)[:, :k]
    ln = 1 + 0.2 * torch.randn(k, generator=gen)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ln
    torch.testing.assert_close(g.rms_norm(x, ln, 1e-6), ref, rtol=1e-5, atol=1e-5)
    y = torch.randn(rows, heads * d + 9, generator=gen)[:, : heads * d + 4]
    ang = torch.rand(rows, d // 2, generator=gen) * 6
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    qk = y[:, : heads * d].reshape(rows, heads, d)
    x1, x2 = qk[..., : d // 2], qk[..., d // 2:]
    cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2:]
    want = y.clone()
    want[:, : heads * d] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).view(rows, -1)
    assert g.rope_(y, cs, heads * d, d) is y
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="heads"):
        g.rope_(y, cs, d + 2, d)
    with pytest.raises(ValueError, match="float32"):
        g.rms_norm(x.double(), ln, 1e-6)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias,gelu", [(False, False), (True, True)])
def test_mlp_block_is_the_layer_after_attention(rows, bias, gelu):
    """The fused block against the torch formulas of the three ops it replaces: the residual
    add of o's projection, RMSNorm, the gated MLP, the residual add of down's projection (odd
    sizes, so every thread's share ends mid-block)."""
    gen = _gen(5 + rows)
    hidden, q, inter = 37, 24, 29
    o_w, gu_w, d_w = (torch.randn(*s, generator=gen) / 5 for s in
                      ((hidden, q), (2 * inter, hidden), (hidden, inter)))
    o_b, gu_b, d_b = ((torch.randn(n, generator=gen) if bias else None)
                      for n in (hidden, 2 * inter, hidden))
    ln = 1 + 0.2 * torch.randn(hidden, generator=gen)
    o = torch.randn(rows, q + 3, generator=gen)[:, :q]
    r = torch.randn(rows, hidden, generator=gen)
    r1 = r + F.linear(o, o_w, o_b)
    n = r1 * torch.rsqrt(r1.pow(2).mean(-1, keepdim=True) + 1e-6) * ln
    gate_up = F.linear(n, gu_w, gu_b)
    act = F.gelu(gate_up[:, :inter], approximate="tanh") if gelu else F.silu(gate_up[:, :inter])
    want = r1 + F.linear(act * gate_up[:, inter:], d_w, d_b)
    block = g.bind_mlp_block(o_w, o_b, ln, 1e-6, gu_w, gu_b, d_w, d_b, gelu)
    got = r.clone()
    assert block(o, got) is got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="MLP block"):
        block(torch.randn(rows, q + 1), got)
    with pytest.raises(ValueError, match="fit together"):
        g.bind_mlp_block(o_w, o_b, ln, 1e-6, gu_w[:-2], gu_b, d_w, d_b)


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 1000, 32000])
def test_argmax_is_numpys(n):
    """The sampler's row argmax: NumPy's answer (the first maximum; the first NaN of a row
    with one) for random rows, ties, -inf rows, NaN rows and strided rows, on 1 and 2
    threads."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n + 7, generator=gen)[:, 3:3 + n]  # strided rows
    x[1] = 2.0  # all tied: index 0
    x[2] = float("-inf")
    if n > 2:
        x[3, n // 2] = x[3, n - 1] = 50.0  # tie between two positions: the first
        x[4, n // 3] = float("nan")
        x[4, n - 1] = float("nan")
        x[5, 1] = float("inf")
    x[6, n - 1] = 100.0  # the last position
    expect = torch.from_numpy(x.numpy().argmax(axis=-1))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            assert torch.equal(g.argmax(x), expect)
        finally:
            torch.set_num_threads(2)
    assert g.argmax(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="argmax"):
        g.argmax(x.double())
    with pytest.raises(ValueError, match="argmax"):
        g.argmax(x.t())
