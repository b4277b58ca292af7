"""The panel GEMM (kvserve/model/panel_gemm.py) against F.linear: every tile height (1 to 8 rows
and more than one tile), output widths that end mid-panel, K of any size, biases, the residual
add in place, strided x; the kernel built for older x86 levels too (its vector width follows
the instruction set); bad arguments are errors. End-to-end parity with transformers through
it: tests/test_model_parity.py (all-panel and mixed plans)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import panel_gemm
from kvserve.model.cpu_ext import CXXFLAGS, load_library

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
