"""Row tiles for the K-quants (kernels/cpu/csrc/qtiles_k.h): Q4_K and Q6_K super-blocks of 16
output features repacked at load, against the same independent references as their file
layout (tests/test_quant_kquants.py): gguf.quants' dequantization of the blocks, and numpy on
x quantized as the kernel quantizes it. Each instruction-set build: the AVX-512 VNNI tile
kernel where the CPU has it, and the other builds' path (each feature's row back in the
file's layout, then the row kernel). Mutated tiles (a feature's scale moved to another, the
nibble halves or the sub-block pairs exchanged, Q6_K's high bits in another order) fail the
same checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_kquants import K_TYPES, _kblocks, _tight_ok
from test_quant_linear import ISAS, _bound, _kernel

from kvserve.kernels.cpu import qgemv

N, K = 48, 256 * 3  # three tiles; an odd number of super-blocks


def _tiles(kern, type_name: str, n: int = N, k: int = K, seed: int = 1):
    wq, w = _kblocks(type_name, n, k, seed)
    return wq, kern.pack_tiles(wq, type_name, k), w


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_tiles_hold_the_same_blocks(type_name):
    kern = _kernel(None)
    wq, wt, w = _tiles(kern, type_name)
    assert wt.shape == wq.shape and not torch.equal(wt, wq)
    assert torch.equal(kern.pack_tiles(wt, type_name, K, unpack=True), wq)
    own = wq.clone()
    kern.pack_tiles(own, type_name, K, in_place=True)
    assert torch.equal(own, wt)
    deq = kern.dequantize(wt, type_name, K, tiled=True).numpy().astype(np.float64)
    assert np.array_equal(deq, w)  # gguf.quants' values, bit for bit
    ids = torch.tensor([[0, 17], [47, 31]])
    assert torch.equal(kern.embed(wt, type_name, K, ids, tiled=True),
                       kern.embed(wq, type_name, K, ids))


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 37])
def test_k_tile_kernel_matches_reference(isa, type_name, rows):
    kern = _kernel(isa[1])
    _, wt, w = _tiles(kern, type_name, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    y = kern.linear(x, wt, type_name, K, tiled=True).double().numpy()
    xn = x.numpy()
    assert (np.abs(y - xn.astype(np.float64) @ w.T) <= _bound(xn, w)).all()
    assert _tight_ok(y, xn, w)


@pytest.mark.parametrize("isa", ISAS[:2], ids=[i[0] for i in ISAS[:2]])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_tile_epilogues(isa, type_name):
    """Bias, residual add and the gated modes on K tiles (gate tiles, then up tiles) equal
    the file layout's kernel on the same blocks."""
    kern = _kernel(isa[1])
    inter, rows = 32, 11
    wq, wt, _ = _tiles(kern, type_name, 2 * inter, 512, seed=4)
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(rows, 512, generator=g), torch.randn(2 * inter, generator=g)
    for mode in (qgemv.MODE_STORE, qgemv.MODE_SILU_MUL, qgemv.MODE_GELU_MUL):
        want = kern.linear(x, wq, type_name, 512, bias, mode)
        got = kern.bind(wt, type_name, 512, bias, mode, tiled=True)(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # summation order
    residual = torch.randn(rows, 2 * inter, generator=g)
    want = residual + kern.linear(x, wq, type_name, 512, bias)
    kern.linear(x, wt, type_name, 512, bias, qgemv.MODE_ADD, residual, tiled=True)
    torch.testing.assert_close(residual, want, rtol=1e-4, atol=1e-3)


def _swap(t: torch.Tensor, a: int, b: int, size: int) -> None:
    t[a: a + size], t[b: b + size] = t[b: b + size].clone(), t[a: a + size].clone()


def _mutations(type_name: str) -> dict:
    """Ways the K tile layout could be read wrong, on a tiled weight's first super-block."""
    def halves(t, at):  # low and high nibbles exchanged in one 64-byte group
        b = t[at: at + 64]
        t[at: at + 64] = (b >> 4) | ((b & 0x0F) << 4)

    if type_name == "Q4_K":
        return {
            "d of features 0 and 1": lambda t: _swap(t, 0, 2, 2),
            "scale bytes of features 0 and 1": lambda t: [_swap(t, 64 + 16 * i, 65 + 16 * i, 1)
                                                         for i in range(12)],
            "scale 1 read as its min": lambda t: _swap(t, 64 + 16, 64 + 16 * 5, 16),
            "nibble halves": lambda t: halves(t, 256),
            "sub-block pairs 0 and 1": lambda t: _swap(t, 256, 256 + 512, 512),
        }
    return {
        "d of features 0 and 1": lambda t: _swap(t, 0, 2, 2),
        "scales of the two halves": lambda t: _swap(t, 32, 48, 16),
        "ql of q 0 and 1": lambda t: _swap(t, 288, 288 + 512, 512),
        "nibble halves": lambda t: halves(t, 288),
        "qh 2-bit fields reversed": lambda t: t[2336: 2336 + 1024].copy_(
            ((t[2336: 3360] & 0x03) << 6) | ((t[2336: 3360] & 0x0C) << 2)
            | ((t[2336: 3360] & 0x30) >> 2) | ((t[2336: 3360] & 0xC0) >> 6)),
    }


@pytest.mark.parametrize("isa", ISAS[:1] + ISAS[2:], ids=["native", "plain"])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_mutated_k_tiles_are_caught(isa, type_name):
    kern = _kernel(isa[1])
    _, wt, w = _tiles(kern, type_name, seed=3)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    xn = x.numpy()
    assert _tight_ok(kern.linear(x, wt, type_name, K, tiled=True).double().numpy(), xn, w)
    for label, mutate in _mutations(type_name).items():
        bad = wt.clone().view(-1)
        mutate(bad)
        y = kern.linear(x, bad.view_as(wt), type_name, K, tiled=True).double().numpy()
        assert not _tight_ok(y, xn, w), label
        deq = kern.dequantize(bad.view_as(wt), type_name, K, tiled=True).numpy()
        assert not np.array_equal(deq.astype(np.float64), w), label
