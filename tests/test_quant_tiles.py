"""Row tiles (kernels/cpu/csrc/qtiles.h, qtiles_k.h): Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks and
Q4_K/Q5_K/Q6_K super-blocks repacked into tiles of 16 output features, against the same
independent references as the row layout (tests/test_quant_linear.py, test_quant_kquants.py):
gguf.quants' dequantization of the file's blocks, and PyTorch / numpy on x quantized as the
kernel quantizes it. Each instruction-set build: the AVX-512 VNNI tile kernel where the CPU
has it, the AVX2 one (qtiles_avx2.h, qtiles_k_avx2.h: the -march=x86-64-v3 build that
KVSERVE_CPU_ISA=avx2 makes, so exercised on an AVX-512 machine too), and the plain build's
loops (for the K-quants each feature's row back in the file's layout, then the row kernel),
at row counts that fill and split its register passes (1, 3, 8, 13, 16, 33, 37), and at the
largest codes (its int16 sums' limit). Mutated tiles (a scale moved to another feature,
nibble halves swapped, Q5's fifth bits or Q6_K's high bits in another order, K sub-blocks
exchanged) must fail the same checks, and the one-call decode step on tiled
weights equals the layer path bit for bit at more rows than the row layout's limit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from test_quant_kquants import K_TYPES, _kblocks
from test_quant_linear import ISAS, TYPES, _bound, _expected_tiles, _kernel, _quantized_x, \
    _weight

from kvserve.kernels.cpu import qgemv

N, K = 48, 32 * 19  # three tiles; k not a multiple of 256
ALL = TYPES + K_TYPES


def _k(type_name: str) -> int:
    """The rows' width a test uses: K, or for the K-quants three super-blocks."""
    return 256 * 3 if type_name in K_TYPES else K


def _tiles(kern, type_name: str, n: int, k: int, seed: int):
    wq, w = (_kblocks if type_name in K_TYPES else _weight)(type_name, n, k, seed)
    return wq, kern.pack_tiles(wq, type_name, k), w


def _group(kern, type_name: str) -> int:
    """x's blocks of 32 per scale: 8 for the K-quants on the SIMD builds (qgemv.cpp: one scale
    per 256 values), else 1."""
    return 8 if type_name in K_TYPES and kern.isa != "C++" else 1


def _tight_ok(y: np.ndarray, x: torch.Tensor, w: np.ndarray, group: int = 1) -> bool:
    """y equals x W^T with x quantized as the kernel does, to float32 rounding."""
    xn = x.numpy()
    xq, _ = _quantized_x(xn, group)
    tight = 1e-5 * (np.abs(xn).astype(np.float64) @ np.abs(w).T) + 1e-6
    return bool((np.abs(y - xq @ w.T) <= tight).all())


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
def test_tile_kernel_where_the_cpu_has_it(isa):
    """The native build has the AVX-512 VNNI tile kernel exactly where this CPU has AVX-512
    F, BW and VNNI (so the loader tiles the weights there, and only there); the AVX2 and plain
    builds never do (they run tiles through their plain loops when forced)."""
    kern = _kernel(isa[1])
    assert kern.tiles_native == (isa[0] == "native" and _expected_tiles())


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
def test_tiles_pay_where_a_simd_tile_kernel_runs_them(isa):
    """The loader tiles a type where the build's tile kernel beats the rows: every tile type
    on the VNNI kernel; on the AVX2 one every type but Q8_0 (its table is also the LM head's,
    whose float-x path has no AVX2 tile kernel); none on the plain loop."""
    kern = _kernel(isa[1])
    simd = kern.isa != "C++"
    for type_name in ALL:
        want = kern.tiles_native or (simd and type_name != "Q8_0")
        assert kern.tiles_pay(type_name) == want, type_name
    assert not kern.tiles_pay("F16")


@pytest.mark.parametrize("type_name", ALL)
def test_tiles_hold_the_same_blocks(type_name):
    kern, k = _kernel(None), _k(type_name)
    wq, wt, w = _tiles(kern, type_name, N, k, seed=1)
    assert wt.shape == wq.shape and not torch.equal(wt, wq)
    assert torch.equal(kern.pack_tiles(wt, type_name, k, unpack=True), wq)
    own = wq.clone()  # in place (the loader's way), tile by tile through a row aside
    assert kern.pack_tiles(own, type_name, k, in_place=True).data_ptr() == own.data_ptr()
    assert torch.equal(own, wt)
    assert torch.equal(kern.pack_tiles(own, type_name, k, unpack=True, in_place=True), wq)
    deq = kern.dequantize(wt, type_name, k, tiled=True).numpy().astype(np.float64)
    assert np.array_equal(deq, w)  # gguf.quants' values, bit for bit
    ids = torch.tensor([[0, 17], [47, 31]])
    assert torch.equal(kern.embed(wt, type_name, k, ids, tiled=True),
                       kern.embed(wq, type_name, k, ids))


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", ALL)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 33, 37])
def test_tile_kernel_matches_reference(isa, type_name, rows):
    kern, k = _kernel(isa[1]), _k(type_name)
    _, wt, w = _tiles(kern, type_name, N, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kern.linear(x, wt, type_name, k, tiled=True).double().numpy()
    exact = x.numpy().astype(np.float64) @ w.T
    group = _group(kern, type_name)
    assert (np.abs(y - exact) <= _bound(x.numpy(), w, group)).all()
    assert _tight_ok(y, x, w, group)


# The code bytes of a block in the file's layout (offset, end, byte): every code set to its
# largest value (Q8_0: +127), for the saturation test below.
LARGEST_CODES = {"Q8_0": ((2, 34, 0x7F),), "Q4_0": ((2, 18, 0xFF),), "Q4_1": ((4, 20, 0xFF),),
                 "Q5_0": ((2, 22, 0xFF),), "Q5_1": ((4, 24, 0xFF),), "Q4_K": ((16, 144, 0xFF),),
                 "Q5_K": ((16, 176, 0xFF),), "Q6_K": ((0, 192, 0xFF),)}


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", ALL)
def test_tiles_at_the_largest_codes(isa, type_name):
    """Every code at its largest and x near +127 everywhere: the int16 sums that the AVX2
    kernel keeps before widening them (qtiles_avx2.h's int16_groups) are at their largest, so
    one group more than each type allows saturates and fails this (random blocks never
    come near it). Against gguf.quants' values of the same blocks."""
    kern, k = _kernel(isa[1]), _k(type_name)
    wq, _ = (_kblocks if type_name in K_TYPES else _weight)(type_name, N, k, seed=6)
    bb = qgemv.BLOCK_BYTES[type_name]
    blocks = wq.numpy().reshape(N, -1, bb).copy()
    for start, end, byte in LARGEST_CODES[type_name]:
        blocks[..., start:end] = byte
    raw = blocks.reshape(N, -1)
    w = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)).astype(np.float64)
    wt = kern.pack_tiles(torch.from_numpy(raw), type_name, k)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 3, 5, 9):
        x = 1.0 + 0.001 * torch.rand(rows, k, generator=g)
        y = kern.linear(x, wt, type_name, k, tiled=True).double().numpy()
        assert _tight_ok(y, x, w, _group(kern, type_name)), rows


@pytest.mark.parametrize("isa", ISAS[:2], ids=[i[0] for i in ISAS[:2]])
@pytest.mark.parametrize("type_name", ALL)
def test_tile_epilogues(isa, type_name):
    """Bias, residual add and the gated modes on tiles (gate tiles, then up tiles) equal the
    row layout's kernel on the same blocks."""
    kern, k = _kernel(isa[1]), _k(type_name)
    inter, rows = 32, 11
    wq, wt, _ = _tiles(kern, type_name, 2 * inter, k, seed=4)
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(2 * inter, generator=g)
    for mode in (qgemv.MODE_STORE, qgemv.MODE_SILU_MUL, qgemv.MODE_GELU_MUL):
        want = kern.linear(x, wq, type_name, k, bias, mode)
        got = kern.bind(wt, type_name, k, bias, mode, tiled=True)(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # summation order
    residual = torch.randn(rows, 2 * inter, generator=g)
    want = residual + kern.linear(x, wq, type_name, k, bias)
    kern.linear(x, wt, type_name, k, bias, qgemv.MODE_ADD, residual, tiled=True)
    torch.testing.assert_close(residual, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("rows", [1, 6, 37])
def test_head_on_q8_0_tiles_has_16_bit_x(isa, rows):
    """The LM head's path on tiles: x in 16-bit blocks (scale amax / 32767), so the error is
    that rounding's bound, 256 times tighter than 8-bit x's; an outlier in x included."""
    kern = _kernel(isa[1])
    _, wt, w = _tiles(kern, "Q8_0", N, K, seed=5)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(9))
    x[:, 7] = 40.0
    y = kern.linear(x, wt, "Q8_0", K, float_x=True, tiled=True).double().numpy()
    xn = x.numpy()
    d16 = np.abs(xn.reshape(rows, -1, 32)).max(axis=2).astype(np.float64) / 32767
    wb = np.abs(w).reshape(N, -1, 32).sum(axis=2)
    bound = d16 / 2 @ wb.T + 1e-5 * (np.abs(xn).astype(np.float64) @ np.abs(w).T) + 1e-6
    err = np.abs(y - xn.astype(np.float64) @ w.T)
    assert (err <= bound).all()
    assert err.max() < (_bound(xn, w) / 64).max()


def _mutations(type_name: str) -> dict:
    """Ways a tile layout could be wrong, on a tiled weight's first tile block."""
    def swap_scales(t):  # feature 0's scale moved to feature 1
        t[0:2], t[2:4] = t[2:4].clone(), t[0:2].clone()

    qs = 32 + (32 if type_name in ("Q4_1", "Q5_1") else 0) + (64 if type_name[:2] == "Q5" else 0)

    def swap_halves(t):  # low and high nibbles (or Q8_0's first two groups) exchanged
        if type_name == "Q8_0":
            a = t[qs: qs + 64].clone()
            t[qs: qs + 64] = t[qs + 64: qs + 128]
            t[qs + 64: qs + 128] = a
        else:
            b = t[qs: qs + 256]
            t[qs: qs + 256] = (b >> 4) | ((b & 0x0F) << 4)

    if type_name in K_TYPES:
        return _k_mutations(type_name)
    out = {"scale": swap_scales, "halves": swap_halves}
    if type_name[:2] == "Q5":
        qh = qs - 64

        def bit_order(t):  # the file's qh order where the tiles' is expected
            t[qh: qh + 64] = t[qh: qh + 64].flip(0)
        out["fifth bits"] = bit_order
    return out


def _swap(t: torch.Tensor, a: int, b: int, size: int) -> None:
    t[a: a + size], t[b: b + size] = t[b: b + size].clone(), t[a: a + size].clone()


def _k_mutations(type_name: str) -> dict:
    """The same for a K tile super-block (qtiles_k.h's offsets)."""
    def halves(t, at):  # low and high nibbles exchanged in one 64-byte group
        b = t[at: at + 64]
        t[at: at + 64] = (b >> 4) | ((b & 0x0F) << 4)

    if type_name == "Q5_K":  # Q4_K's header; per group g a chunk at 256 + 320 g
        return {
            "d of features 0 and 1": lambda t: _swap(t, 0, 2, 2),
            "scale 1 read as its min": lambda t: _swap(t, 64 + 16, 64 + 16 * 5, 16),
            "nibble halves": lambda t: halves(t, 256),
            "sub-block pairs 0 and 1": lambda t: _swap(t, 256, 256 + 64, 64),
            "fifth bits of groups 0 and 1": lambda t: _swap(t, 256 + 256, 256 + 320 + 256, 64),
            "fifth bits of sub-blocks 0 and 1 exchanged": lambda t: t[512:576].copy_(
                (t[512:576] & 0xFC) | ((t[512:576] & 1) << 1) | ((t[512:576] >> 1) & 1)),
        }
    if type_name == "Q4_K":
        return {
            "d of features 0 and 1": lambda t: _swap(t, 0, 2, 2),
            "scale bytes of features 0 and 1": lambda t: [_swap(t, 64 + 16 * i, 65 + 16 * i, 1)
                                                         for i in range(12)],
            "scale 1 read as its min": lambda t: _swap(t, 64 + 16, 64 + 16 * 5, 16),
            "nibble halves": lambda t: halves(t, 256),
            "sub-block pairs 0 and 1": lambda t: _swap(t, 256, 256 + 512, 512),
        }
    def reverse_qh(t):  # the 2-bit fields of every chunk's qh bytes in reverse order
        for chunk in range(16):
            qh = slice(288 + 192 * chunk + 128, 288 + 192 * chunk + 192)
            t[qh] = ((t[qh] & 0x03) << 6) | ((t[qh] & 0x0C) << 2) | ((t[qh] & 0x30) >> 2) \
                | ((t[qh] & 0xC0) >> 6)

    return {  # Q6_K: per half and group a chunk of 192 bytes at 288: ql q 0, ql q 1, qh
        "d of features 0 and 1": lambda t: _swap(t, 0, 2, 2),
        "scales of the two halves": lambda t: _swap(t, 32, 48, 16),
        "ql of q 0 and 1": lambda t: _swap(t, 288, 288 + 64, 64),
        "nibble halves": lambda t: halves(t, 288),
        "chunks of groups 0 and 1": lambda t: _swap(t, 288, 288 + 192, 192),
        "qh 2-bit fields reversed": reverse_qh,
    }


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", ALL)
def test_mutated_tiles_are_caught(isa, type_name):
    kern, k = _kernel(isa[1]), _k(type_name)
    _, wt, w = _tiles(kern, type_name, N, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    group = _group(kern, type_name)
    assert _tight_ok(kern.linear(x, wt, type_name, k, tiled=True).double().numpy(), x, w,
                     group)
    for label, mutate in _mutations(type_name).items():
        bad = wt.clone().view(-1)
        mutate(bad)
        y = kern.linear(x, bad.view_as(wt), type_name, k, tiled=True).double().numpy()
        assert not _tight_ok(y, x, w, group), label
        deq = kern.dequantize(bad.view_as(wt), type_name, k, tiled=True).numpy()
        assert not np.array_equal(deq.astype(np.float64), w), label


def test_tiles_refuse_what_they_cannot_hold():
    kern = _kernel(None)
    wq, _ = _weight("Q8_0", 40, K, seed=1)  # 40 rows: not whole tiles
    with pytest.raises(ValueError, match="row tiles"):
        kern.pack_tiles(wq, "Q8_0", K)
    with pytest.raises(ValueError, match="row tiles"):
        kern.linear(torch.randn(2, K), wq, "Q8_0", K, tiled=True)
    k4 = torch.zeros(24, qgemv.row_bytes("Q4_K", 256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="row tiles"):
        kern.pack_tiles(k4, "Q4_K", 256)
    assert not qgemv.tileable("Q6_K", 24, 256) and qgemv.tileable("Q6_K", 32, 256)
    assert not qgemv.tileable("Q6_K", 32, 288) and qgemv.tileable("Q5_1", 32, 64)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A Llama whose every projection is 256 values wide or more (quantization="q4_k" makes
    them all Q4_K: the one-call step on K tiles)."""
    import transformers
    from conftest import DECODE_COMMON
    from helpers import save_random_checkpoint

    config = transformers.LlamaConfig(**dict(DECODE_COMMON, hidden_size=256,
                                             intermediate_size=512), tie_word_embeddings=False)
    return save_random_checkpoint(config, tmp_path_factory.mktemp("wide") / "llama")


@pytest.mark.parametrize("quantization", ["q8_0", "q4_k"])
def test_one_call_step_on_tiles_serves_more_rows(quantization, decode_checkpoints, wide_llama,
                                                 monkeypatch):
    """With every projection in tiles the one-call step serves batches past the row layout's
    4 rows (up to quant_decode.TILED_ROWS), and its logits equal the layer path's bit for
    bit (both run the tile kernel at every row count)."""
    from helpers import greedy_ids, random_prompts, record_decode_steps

    from kvserve import LLM
    from kvserve.layers import kernel_choice

    # tiles, and the layer path on the kernel at any rows
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qlayout=tiles,qrows=inf")
    prompts = random_prompts([3, 9, 17, 25, 33, 40, 51, 60, 64, 70], 512, seed=2)
    max_tokens = tuple(4 + 2 * i for i in range(len(prompts)))
    path = wide_llama if quantization == "q4_k" else decode_checkpoints["llama"]
    runs = []
    for fast in (True, False):
        llm = LLM(model=str(path), dtype="float32", quantization=quantization,
                  max_model_len=256, block_size=16)
        weights = llm.engine.runner.model.layers[0].quant_weights
        assert all(w.tiled for w in weights.values())
        assert {w.type_name for w in weights.values()} == {quantization.upper()}
        seen = record_decode_steps(llm, fast)
        runs.append((greedy_ids(llm, prompts, max_tokens), seen))
    (fast_ids, fast_seen), (slow_ids, slow_seen) = runs
    assert fast_ids == slow_ids
    assert max(fast_seen["rows"]) == len(prompts)
    assert len(fast_seen["logits"]) == len(slow_seen["logits"])
    for a, b in zip(fast_seen["logits"], slow_seen["logits"]):
        assert torch.equal(a, b)
