"""The quantized kernel's cache tiles and thread pool (issue 31; kernels/cpu/csrc/qgemv.cpp,
parallel.h) and the measured choice of the integer path (kvserve/layers/kernel_choice.py).

The tiles are 16 output features x x_tile_rows(k) rows of x (64 at the k here) in chunks of
4 rows: the row counts below cross every edge (one partial chunk, one chunk, a chunk and a
row, a partial tile, one tile, a tile and a row, two tiles and two rows) and n = 67 leaves a
partial unit of 3 features. Each mode against its float64 reference on the same 8-bit
quantization of x as the kernel's (test_quant_linear._quantized_x): only float32 rounding of
the sums is left."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_quant_linear import ISAS, TYPES, _kernel, _quantized_x, _weight

from kvserve.kernels.cpu import qgemv
from kvserve.layers import kernel_choice
from kvserve.layers.buckets import BUCKETS

TILE_ROWS = (1, 3, 4, 5, 17, 63, 64, 65, 130)


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1 + np.exp(-g))


def _gelu_tanh(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


@pytest.mark.parametrize("isa", ISAS[:2], ids=[i[0] for i in ISAS[:2]])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", TILE_ROWS)
def test_tiled_modes_match_float64(isa, type_name, rows):
    kern = _kernel(isa[1])
    n, k = 67, 32 * 19  # x_tile_rows(608) = 64
    wq, w = _weight(type_name, 2 * n, k, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(2 * n, generator=g)
    xq, _ = _quantized_x(x.numpy())
    exact = xq @ w.T + bias.double().numpy()  # [rows, 2n]
    scale = np.abs(x.numpy()).astype(np.float64) @ np.abs(w).T + np.abs(bias.numpy())
    tight = 1e-5 * scale + 1e-6

    y = kern.linear(x, wq, type_name, k, bias).double().numpy()
    assert (np.abs(y - exact) <= tight).all()
    residual = torch.randn(rows, 2 * n, generator=g)
    expect = residual.double().numpy() + exact
    kern.linear(x, wq, type_name, k, bias, mode=qgemv.MODE_ADD, out=residual)
    assert (np.abs(residual.double().numpy() - expect) <= tight + 1e-6 * np.abs(expect)).all()
    gate, up = exact[:, :n], exact[:, n:]
    # d(act(g) * u) <= |act'| |u| dg + |act(g)| du, |act'| <= 1.1 for both
    tol = 1.1 * np.abs(up) * tight[:, :n] + (np.abs(gate) + 1) * tight[:, n:] + 1e-5
    for mode, act in ((qgemv.MODE_SILU_MUL, _silu), (qgemv.MODE_GELU_MUL, _gelu_tanh)):
        got = kern.linear(x, wq, type_name, k, bias, mode=mode).double().numpy()
        assert (np.abs(got - act(gate) * up) <= tol).all(), mode


@pytest.mark.parametrize("rows", [1, 5, 65])
def test_float_x_tiles(rows):
    """The LM head's float-x loop on the pool's units (n = 67: a partial unit)."""
    kern = _kernel(None)
    n, k = 67, 32 * 19
    wq, w = _weight("Q8_0", n, k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kern.linear(x, wq, "Q8_0", k, float_x=True).double().numpy()
    xn = x.numpy().astype(np.float64)
    assert (np.abs(y - xn @ w.T) <= 1e-5 * (np.abs(xn) @ np.abs(w).T) + 1e-6).all()


def test_calls_from_two_python_threads():
    """The pool is one per library: a call while another thread's holds it runs on its own
    caller. Both threads' results stay each their own single-threaded result."""
    kern = _kernel(None)
    n, k = 200, 32 * 18
    wq, _ = _weight("Q4_1", n, k, seed=3)
    xs = [torch.randn(r, k, generator=torch.Generator().manual_seed(r)) for r in (1, 7, 40)]
    torch.set_num_threads(2)
    expected = [kern.linear(x, wq, "Q4_1", k) for x in xs]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for it in range(60):
            x = xs[(i + it) % len(xs)]
            y = kern.linear(x, wq, "Q4_1", k)
            if not torch.equal(y, expected[(i + it) % len(xs)]):
                errors.append(f"thread {i} call {it}")

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_crossover_from_bucket_times():
    inf = float("inf")
    n = len(BUCKETS)

    def times(ints, deqs):
        pad = [None] * (n - 1 - len(ints))
        return {"int": [None, *ints, *pad], "dequant": [None, *deqs, *pad]}

    assert kernel_choice.crossover_from(times([1, 2, 3], [5, 5, 5])) == inf
    assert kernel_choice.crossover_from(times([1, 2, 9], [5, 5, 5])) == BUCKETS[2][0]
    assert kernel_choice.crossover_from(times([9, 2, 3], [5, 5, 5])) == kernel_choice.DECODE_ROWS
    # the first loss decides: a win above it (noise) does not extend the integer path
    assert kernel_choice.crossover_from(times([1, 9, 3], [5, 5, 5])) == BUCKETS[1][0]


def test_env_override_picks_the_path(monkeypatch):
    """KVSERVE_KERNEL=qrows=N fixes the crossover: "inf" runs the integer kernel at 65 rows (its
    result is the kernel's own), 4 the dequantized copy + F.linear (float32 GEMM: equal to
    x @ W_deq^T up to MKL's rounding, not the kernel's 8-bit x)."""
    from kvserve.layers import quant_linear as ql

    wq, w = _weight("Q4_1", 48, 32 * 8, seed=2)
    weight = ql.QuantWeight(wq, "Q4_1", 32 * 8)
    x = torch.randn(65, 32 * 8, generator=torch.Generator().manual_seed(1))
    kern = _kernel(None)
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=inf")
    lin = ql.QuantizedLinear(weight)
    assert lin.int_rows == float("inf")
    assert torch.equal(lin.apply(x), kern.linear(x, wq, "Q4_1", 32 * 8))
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=4")
    lin = ql.QuantizedLinear(weight)
    assert lin.int_rows == 4
    torch.testing.assert_close(lin.apply(x).double(), x.double() @ torch.from_numpy(w).T,
                               rtol=1e-4, atol=1e-4)
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=lots")
    with pytest.raises(ValueError, match="KVSERVE_KERNEL"):
        ql.QuantizedLinear(weight)


def test_measured_crossover_is_cached(monkeypatch, tmp_path):
    """Unset, making a method on a row-layout weight (at load) measures both paths on the
    projection's own weight once (a fake timing here) and caches the crossover; a second
    projection of the shape class takes it from this process's table without measuring, a
    fresh process's table from the cache file; `apply` never measures."""
    from kvserve.layers import quant_linear as ql

    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_choice, "_measured", {})
    calls = []

    def fake_measure(factories, max_bucket, repeats, only):
        (shape, runs), = factories.items()
        calls.append(shape)
        for f in runs.values():
            f(BUCKETS[1][1])()  # each path runs on a probe's x
        ts = {"int": [None] * len(BUCKETS), "dequant": [None] * len(BUCKETS)}
        for b in only:
            ts["int"][b], ts["dequant"][b] = (1.0, 2.0) if b < 3 else (3.0, 2.0)
        return {shape: ts}

    monkeypatch.setattr(kernel_choice.gemm_select, "measure", fake_measure)
    wq, _ = _weight("Q8_0", 32, 32 * 4, seed=4)
    weight = ql.QuantWeight(wq, "Q8_0", 32 * 4)
    lin = ql.QuantizedLinear(weight)
    assert calls == ["Q8_0 32x128"] and lin.int_rows == BUCKETS[2][0]
    assert lin.choice.kernel_at(BUCKETS[2][0]) == "qgemv"
    assert lin.choice.kernel_at(BUCKETS[2][0] + 1) == "dequant"
    lin.apply(torch.randn(1, 32 * 4))
    lin.apply(torch.randn(200, 32 * 4))
    other = ql.QuantizedLinear(weight)
    other.apply_add(torch.randn(200, 32 * 4), torch.zeros(200, 32))
    assert calls == ["Q8_0 32x128"] and other.int_rows == BUCKETS[2][0]
    assert (tmp_path / "qgemm-rows.json").is_file()
    monkeypatch.setattr(kernel_choice, "_measured", {})  # a new process: the file's entry
    assert ql.QuantizedLinear(weight).int_rows == BUCKETS[2][0] and len(calls) == 1


def test_one_override_parses_every_item(monkeypatch):
    """$KVSERVE_KERNEL: a bare GEMM kernel or gemm=, qlayout=, qrows= items, comma-separated;
    an unknown item names the variable; `integer_rows` (deterministic inference) is qrows=inf
    inside it, whatever the variable says, and its old value after."""
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    assert kernel_choice.override() == kernel_choice.Override()
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "onednn")
    assert kernel_choice.override() == kernel_choice.Override(gemm="onednn")
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, " gemm=panel, qlayout=rows ,qrows=16")
    assert kernel_choice.override() == kernel_choice.Override("panel", "rows", 16.0)
    with kernel_choice.integer_rows():
        assert kernel_choice.override().rows == float("inf")
    assert kernel_choice.override().rows == 16.0
    for bad in ("mkl", "qlayout=blocks", "tiles=1"):
        monkeypatch.setenv(kernel_choice.KERNEL_ENV, bad)
        with pytest.raises(ValueError, match="KVSERVE_KERNEL"):
            kernel_choice.override()


def test_choice_follows_the_build_and_the_override(monkeypatch):
    """choose(): tiles exactly where the build's tile kernel pays for the type and the shape
    has tiles (QGemv.tiles_pay, qgemv.tileable), the integer kernel at every row count on
    native tiles, measured otherwise; qlayout= / qrows= force them; a stacked weight runs
    the integer kernel up to its parts' fewest rows."""
    kern = _kernel(None)
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    for type_name, shape in (("Q4_K", (64, 512)), ("Q4_1", (48, 256)), ("Q8_0", (40, 64))):
        c = kernel_choice.choose(type_name, shape)
        tiles = kern.tiles_pay(type_name) and qgemv.tileable(type_name, *shape)
        assert c.layout == ("tiles" if tiles else "rows")
        assert c.kernel == ("qtiles" if tiles else "qgemv")
        assert c.int_rows == (float("inf") if tiles and kern.tiles_native else None)
        assert kernel_choice.choose(type_name, shape, layout="rows").layout == "rows"
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qlayout=tiles,qrows=4")
    c = kernel_choice.choose("Q4_K", (64, 512))
    assert (c.layout, c.int_rows) == ("tiles", 4)
    assert (c.kernel_at(4), c.kernel_at(5)) == ("qtiles", "dequant")
    assert kernel_choice.choose("Q4_K", (40, 512)).layout == "rows"  # no tiles of 40 rows
    with pytest.raises(ValueError, match="runs the"):
        kernel_choice.choose("Q4_K", (64, 512), isa="no-such-isa")
    both = kernel_choice.stacked([kernel_choice.KernelChoice("qtiles", "tiles", float("inf")),
                                  kernel_choice.KernelChoice("qgemv", "rows", 16.0)])
    assert both == kernel_choice.KernelChoice("qtiles+qgemv", "tiles+rows", 16.0)
    assert kernel_choice.stacked([both, kernel_choice.KernelChoice("qgemv", "rows", None)]
                                 ).int_rows is None
