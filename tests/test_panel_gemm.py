"""The panel GEMM (kvserve/kernels/cpu/panel_gemm.py) against F.linear: every tile height (1 to 8 rows
and more than one tile), output widths that end mid-panel, K of any size, biases, the residual
add in place, strided x; its RMSNorm and gated-activation epilogues against torch in
float64; the kernel built for older x86 levels too (its vector width follows the
instruction set); bad arguments are errors. End-to-end parity with transformers through
it: tests/test_model_parity.py (all-panel and mixed plans)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import panel_gemm
from kvserve.kernels.cpu.cpu_ext import CXXFLAGS, load_library

kernel = panel_gemm.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the panel GEMM could not be built")

SHAPES = [(1, 1), (31, 17), (32, 64), (33, 5), (100, 40), (768, 512)]  # (n, k)
ROWS = [0, 1, 2, 3, 5, 7, 8, 9, 17, 64, 67, 200, 385]  # 192-row blocks: 3 of them


def _check(g: panel_gemm.PanelGemm, rows: int, n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:k + 1]  # a row stride past k
    pw = g.pack(w)
    torch.testing.assert_close(g.linear(x, pw, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g.linear(x, pw), F.linear(x, w), atol=1e-4, rtol=1e-4)
    residual = torch.randn(rows, n + 2, generator=gen)[:, :n]  # strided too
    expected = residual + F.linear(x, w, b)
    out = g.linear(x, pw, b, residual=residual)
    assert out.data_ptr() == residual.data_ptr()  # in place
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _check_fused(g: panel_gemm.PanelGemm, rows: int, n: int, k: int, seed: int) -> None:
    """The norm (the rows normed in the call) and the gated epilogue, with and without a bias
    and together, against Hugging Face's RMSNorm formula, F.linear and the
    activations in float64; errors measured against the size of the terms (a product of two
    sums of k terms)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 2, generator=gen)[:, 1:k + 1] * 3  # strided, not unit RMS
    norm_w = torch.rand(k, generator=gen) + 0.5
    w, b = torch.randn(2 * n, k, generator=gen) / k ** 0.5, torch.randn(2 * n, generator=gen)
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    for act, fn in (("silu", F.silu), ("gelu_pytorch_tanh",
                                        lambda t: F.gelu(t, approximate="tanh"))):
        for bias in (b, None):
            gu = F.linear(xn, w.double(), None if bias is None else bias.double())
            expected = fn(gu[:, :n]) * gu[:, n:]
            scale = 1 + gu[:, :n].abs() * gu[:, n:].abs()
            pw = g.pack(w, act)
            for norm in (True, False):
                bound = g.bind(pw, bias, norm_w, 1e-6) if norm else g.bind(pw, bias)
                out = bound(x if norm else xn.float())
                assert out.shape == (rows, n)
                err = ((out.double() - expected).abs() / scale).max().item() if rows else 0
                assert err < 2e-5, (act, bias is None, norm, err)
    # the norm alone, residual added in place
    w1, b1 = w[:n], b[:n]
    residual = torch.randn(rows, n, generator=gen)
    expected = residual.double() + F.linear(xn, w1.double(), b1.double())
    out = g.bind(g.pack(w1), b1, norm_w, 1e-6)(x, residual)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (17, 33), (40, 64), (1408, 512)])
def test_norm_and_gated_epilogues(n, k):
    for rows in (0, 1, 2, 7, 8, 9, 64, 200):
        _check_fused(kernel, rows, n, k, seed=rows * 100 + n)


def test_gated_activations_at_extremes():
    """SiLU and GELU-tanh of the epilogue (through exp(-|x|)) over the float range, NaN and
    infinities included, against torch's float32 ops: gate = up = x, put in through the bias
    (a GEMM term 0 * inf would be NaN)."""
    x = torch.cat([torch.linspace(-100, 100, 4001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("inf"), float("-inf"),
                                 float("nan")])])
    for act, fn in (("silu", F.silu), ("gelu_pytorch_tanh",
                                        lambda t: F.gelu(t, approximate="tanh"))):
        pw = kernel.pack(torch.zeros(2 * x.numel(), 1), act=act)
        out = kernel.bind(pw, torch.cat([x, x]))(torch.ones(1, 1))[0]
        expected = fn(x) * x
        assert torch.equal(out.isnan(), expected.isnan())
        finite = expected.isfinite()
        infinite = ~finite & ~expected.isnan()
        assert torch.equal(out[infinite], expected[infinite])
        # within float32 rounding of act(x) * x: GELU's 1 + tanh cancels for negative x, in
        # torch as here, so the bound grows with x^2
        o, e, xf = out[finite].double(), expected[finite].double(), x[finite].double()
        assert ((o - e).abs() <= 2e-6 * e.abs() + 2e-7 * (1 + xf * xf)).all(), act


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_matches_torch(n, k):
    for rows in ROWS:
        _check(kernel, rows, n, k, seed=rows * 1000 + n)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(kernel, 19, 200, 33, seed=threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "sse2"])
def test_built_for_an_older_x86(march):
    """The test machine builds with -march=native; the 8- and 4-lane tiles (6 rows over half and
    quarter panels) are built here and checked the same way."""
    flags = tuple(f"-march={march}" if f.startswith("-march") else f for f in CXXFLAGS)
    lib = load_library(panel_gemm.SOURCE, flags)
    assert lib is not None, f"the panel GEMM did not build with -march={march}"
    g = panel_gemm.PanelGemm(lib)
    # tiles of 6 rows over half (AVX2) or quarter (SSE) panels: last panels of 1 to 4 parts,
    # two 192-row blocks
    for rows in (1, 2, 3, 4, 6, 7, 13, 64, 200):
        for n, k in (*SHAPES[1:4], (40, 9), (56, 33), (120, 7)):
            _check(g, rows, n, k, seed=rows + n)
        # gated widths of 1 to 3 vector pairs, and of whole panels of pairs (packed by one
        # strided copy)
        for n, k in ((3, 5), (12, 40), (20, 9), (16, 24), (32, 7)):
            _check_fused(g, rows, n, k, seed=rows + n)


def _reference_layout(w: torch.Tensor, width: int, lanes: int, gated: bool) -> torch.Tensor:
    """The packed layout by its definition, a row at a time: rows (gate, up pairs of `lanes`
    rows, zero past the gate's or up's end, if gated) in panels of `width`, [panels, k,
    width], zero past the last row."""
    n, k = w.shape
    rows = list(w)
    if gated:
        i = n // 2
        rows = [w[half * i + g * lanes + lane] if g * lanes + lane < i else torch.zeros(k)
                for g in range(-(-i // lanes)) for half in (0, 1) for lane in range(lanes)]
    out = torch.zeros(-(-len(rows) // width), k, width)
    for r, row in enumerate(rows):
        out[r // width, :, r % width] = row
    return out


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_packed_layout_for_every_vector_width(lanes):
    """`pack` (one strided copy where the weight fills whole panels, else through a padded
    copy) lays every weight out as the definition says, for each build's vector width."""
    import copy

    g = copy.copy(kernel)
    g.lanes = lanes
    gen = torch.Generator().manual_seed(lanes)
    for n in (1, 7, 31, 32, 33, 64, 96, 100, 130, 192):
        for k in (1, 5, 64):
            w = torch.randn(n, k, generator=gen)
            pw = g.pack(w)
            assert (pw.n, pw.k, pw.cols) == (n, k, n)
            assert torch.equal(pw.packed, _reference_layout(w, g.width, lanes, False))
            if n % 2 == 0:
                pw = g.pack(w, "silu")
                ref = _reference_layout(w, g.width, lanes, True)
                assert (pw.n, pw.cols, pw.lanes) == (n // 2, -(-n // 2 // lanes) * 2 * lanes,
                                                     lanes)
                assert torch.equal(pw.packed, ref), (n, k)


def test_bad_arguments_are_errors():
    pw = kernel.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="x must be"):
        kernel.linear(torch.randn(2, 5), pw)  # wrong k
    with pytest.raises(ValueError, match="x must be"):
        kernel.linear(torch.randn(4, 2).t(), pw)  # k not unit-stride
    with pytest.raises(ValueError, match="x must be"):
        kernel.linear(torch.randn(2, 4, dtype=torch.float64), pw)
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(torch.randn(2, 4), pw, torch.randn(7))
    with pytest.raises(ValueError, match="residual"):
        kernel.linear(torch.randn(2, 4), pw, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="packs 2-D float32"):
        kernel.pack(torch.randn(8, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm weight"):
        kernel.bind(pw, norm_weight=torch.ones(5))
    with pytest.raises(ValueError, match="gated activation"):
        kernel.pack(torch.randn(7, 4), act="silu")  # gate | up needs an even count
    with pytest.raises(ValueError, match="gated activation"):
        kernel.pack(torch.randn(8, 4), act="relu")
    gated = kernel.pack(torch.randn(8, 4), act="silu")
    with pytest.raises(ValueError, match="bias"):
        kernel.bind(gated, torch.randn(4))  # gate | up's bias is 8 wide
    with pytest.raises(ValueError, match="no residual"):
        kernel.bind(gated)(torch.randn(2, 4), torch.randn(2, 4))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
def test_a_gated_weight_of_another_vector_width_is_refused():
    """(gate, up) pairs are a layout of the build that packed them: a build of another width
    refuses the weight (before, it read past the pairs and wrote past the output rows)."""
    flags = tuple("-march=x86-64" if f.startswith("-march") else f for f in CXXFLAGS)
    sse = panel_gemm.PanelGemm(load_library(panel_gemm.SOURCE, flags))
    if sse.lanes == kernel.lanes:
        pytest.skip("this machine's build has SSE's vector width")
    with pytest.raises(ValueError, match="packed for"):
        sse.bind(kernel.pack(torch.randn(8, 5), act="silu"))
    # and the kernel itself checks the column count it is given
    pw = kernel.pack(torch.randn(8, 5), act="silu")
    bound = kernel.bind(pw)
    bound._args.cols = pw.cols + 2 * kernel.lanes
    with pytest.raises(ValueError, match="unsupported sizes"):
        bound(torch.randn(3, 5))
