"""The K-quants (issue 31; Q5_K issue 48): GGUF Q4_K, Q5_K and Q6_K blocks kept in their
super-block format and run by the C++ kernel (kernels/cpu/qgemv.py), and the embedding lookup
on a quantized table.

The references are independent of the kernel: `gguf.quants.dequantize` (the llama.cpp
project's own numpy reading of the layouts) and float64 products in numpy. The kernel
quantizes x to 8-bit blocks of 32 as for the 32-value types, with one scale per 256 values
on its SIMD builds (`_group`), so the bound of test_quant_linear.py holds (`_bound`: each
x_i moves by at most d_b / 2), and against the same quantization of x done in numpy only
float32 rounding of the sums is left.
`gguf.quants.quantize` has no K-quant encoder: the kernel tests use random blocks (random
bytes, sane f16 scales), the end-to-end test `gguf_files.quantize_k`, whose round trip is
checked through gguf.quants.dequantize here too."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from test_quant_linear import ISAS, PLAIN, _bound, _expected_native_isa, _expected_tiles, \
    _kernel, _quantized_x, _weight, prefill_error

from kvserve.kernels.cpu import qgemv

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _kblocks(type_name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random valid blocks (every byte random but the f16 scales: d, dmin in [0.5e-3, 2e-3],
    so no inf or NaN) as uint8 [n, row bytes], and their float64 values by gguf.quants."""
    rng = np.random.default_rng(seed)
    nb, bb = k // 256, qgemv.BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    for at in ((208,) if type_name == "Q6_K" else (0, 2)):
        raw[..., at:at + 2] = rng.uniform(0.5e-3, 2e-3, (n, nb, 1)).astype(np.float16) \
            .view(np.uint8)
    raw = raw.reshape(n, -1)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    return torch.from_numpy(raw), ref


def _group(kern: qgemv.QGemv) -> int:
    """x's blocks of 32 per scale for the K-quants: 8 on the SIMD builds (the AVX2 row dot sums
    a super-block as integers), 1 in plain C++."""
    return 1 if kern.isa == "C++" else 8


def _tight_ok(y: np.ndarray, x: np.ndarray, w: np.ndarray, group: int) -> bool:
    """The kernel's products against the same 8-bit quantization of x, to float32 rounding."""
    xq, _ = _quantized_x(x, group)
    tight = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-6
    return bool((np.abs(y - xq @ w.T) <= tight).all())


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 37])
def test_kernel_matches_reference(isa, type_name, rows):
    kern = _kernel(isa[1])
    assert kern.isa == {"avx2": "AVX2", "plain": "C++"}.get(isa[0], _expected_native_isa())
    n, k = 67, 256 * 3  # three super-blocks: an odd count of them, n not a multiple of 4
    wq, w = _kblocks(type_name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kern.linear(x, wq, type_name, k).double().numpy()
    xn = x.numpy()
    assert (np.abs(y - xn.astype(np.float64) @ w.T) <= _bound(xn, w, _group(kern))).all()
    assert _tight_ok(y, xn, w, _group(kern))


@pytest.mark.parametrize("isa", ISAS[:2], ids=[i[0] for i in ISAS[:2]])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_kernel_epilogues(isa, type_name):
    """Bias, residual add, SiLU and GELU-tanh of [gate; up] on the K-quant path, each against
    its float64 reference on the kernel's own product."""
    kern = _kernel(isa[1])
    inter, k, rows = 24, 512, 3
    wq, _ = _kblocks(type_name, 2 * inter, k, seed=7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(2 * inter, generator=g)
    plain = kern.linear(x, wq, type_name, k).double()
    torch.testing.assert_close(kern.linear(x, wq, type_name, k, bias).double(),
                               plain + bias.double(), rtol=1e-6, atol=1e-5)
    residual = torch.randn(rows, 2 * inter, generator=g)
    expect = residual.double() + plain
    kern.bind(wq, type_name, k, mode=qgemv.MODE_ADD)(x, residual)
    torch.testing.assert_close(residual.double(), expect, rtol=1e-6, atol=1e-5)
    gate, up = plain[:, :inter], plain[:, inter:]
    silu = kern.linear(x, wq, type_name, k, mode=qgemv.MODE_SILU_MUL).double()
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    gelu = kern.bind(wq, type_name, k, mode=qgemv.MODE_GELU_MUL)(x).double()
    torch.testing.assert_close(gelu, torch.nn.functional.gelu(gate, approximate="tanh") * up,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_dequantize_is_gguf_quants(type_name):
    kern = _kernel(None)
    wq, w = _kblocks(type_name, 33, 512, seed=11)
    assert np.array_equal(kern.dequantize(wq, type_name, 512).numpy().astype(np.float64), w)


def _swap_nibbles(b: np.ndarray) -> np.ndarray:
    return ((b << 4) | (b >> 4)).astype(np.uint8)


def _mutations(type_name: str) -> dict[str, callable]:
    """Each a change to one row's first super-block (Q4_K's scale bytes at 4..15: sub-block
    j's scale in byte j (j < 4), its min in j + 4, the high ones' low bits in j + 4 (j >= 4)
    and their top bits in the top 2 bits of bytes j - 4 and j) that a wrong reading of the layout
    would make silently: the nibble halves swapped, one sub-block's scale or min moved."""
    if type_name == "Q5_K":  # Q4_K's scales, qh at 16..47, the nibbles at 48..175
        return {
            "nibbles swapped": lambda r: r[48:176].__setitem__(slice(None),
                                                              _swap_nibbles(r[48:176])),
            "fifth bits of sub-blocks 0 and 1 exchanged": lambda r: r[16:48].__setitem__(
                slice(None), ((r[16:48] & 0xFC) | ((r[16:48] & 1) << 1)
                              | ((r[16:48] >> 1) & 1)).astype(np.uint8)),
            "fifth bits of values 0..15 and 16..31 exchanged": lambda r: r[16:48].__setitem__(
                slice(None), np.roll(r[16:48], 16)),
            "scale 6 (high bits)": lambda r: r.__setitem__(6, r[6] ^ 0x80),
            "min 2": lambda r: r.__setitem__(10, r[10] ^ 0x20),
        }
    if type_name == "Q4_K":
        return {
            "nibbles swapped": lambda r: r[16:144].__setitem__(slice(None),
                                                              _swap_nibbles(r[16:144])),
            "scale 1 (low bits)": lambda r: r.__setitem__(5, r[5] ^ 0x20),
            "scale 6 (high bits)": lambda r: r.__setitem__(6, r[6] ^ 0x80),
            "min 2": lambda r: r.__setitem__(10, r[10] ^ 0x20),
            "min 5 (high bits)": lambda r: r.__setitem__(13, r[13] ^ 0x80),
        }
    return {
        "ql nibbles swapped": lambda r: r[0:128].__setitem__(slice(None),
                                                            _swap_nibbles(r[0:128])),
        "qh 2-bit fields reversed": lambda r: r[128:192].__setitem__(slice(None), (
            ((r[128:192] & 0x03) << 6) | ((r[128:192] & 0x0C) << 2)
            | ((r[128:192] & 0x30) >> 2) | ((r[128:192] & 0xC0) >> 6)).astype(np.uint8)),
        "scale 5": lambda r: r.__setitem__(192 + 5, r[192 + 5] ^ 0x40),
        "scale 14": lambda r: r.__setitem__(192 + 14, r[192 + 14] ^ 0x40),
    }


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_mutated_blocks_are_caught(isa, type_name):
    """The checks above are sensitive to the layout: the same blocks with a nibble order or
    one scale / min changed give products (and dequantized values) that fail them against
    the original blocks' reference, while the unchanged blocks pass. (The tight check, on
    the same quantization of x: the worst-case activation bound alone is ~20x the typical
    error on random data, loose enough to let a one-sub-block change through.)"""
    kern = _kernel(isa[1])
    n, k, rows = 8, 512, 4
    wq, w = _kblocks(type_name, n, k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    xn = x.numpy()
    assert _tight_ok(kern.linear(x, wq, type_name, k).double().numpy(), xn, w, _group(kern))
    for label, mutate in _mutations(type_name).items():
        bad = wq.numpy().copy()
        mutate(bad[3])  # row 3's first super-block
        bad_t = torch.from_numpy(bad)
        y = kern.linear(x, bad_t, type_name, k).double().numpy()
        assert not _tight_ok(y, xn, w, _group(kern)), label
        assert not np.array_equal(kern.dequantize(bad_t, type_name, k).numpy(), w), label
        assert np.array_equal(np.delete(kern.dequantize(bad_t, type_name, k).numpy(), 3, 0),
                              np.delete(w, 3, 0)), label  # only row 3 moved


def test_k_quants_need_whole_super_blocks():
    kern = _kernel(None)
    wq, _ = _weight("Q4_1", 4, 288, seed=1)
    assert not qgemv.fits("Q4_K", 288) and qgemv.fits("Q4_K", 512) and qgemv.fits("Q4_1", 288)
    with pytest.raises(ValueError, match="multiple of 256"):
        kern.linear(torch.randn(1, 288), wq, "Q4_K", 288)


@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", *K_TYPES))
def test_embedding_rows_are_gguf_quants(type_name):
    """The lookup on a quantized table: the rows asked for (repeats, any order, any shape of
    ids) equal gguf.quants.dequantize's rows exactly; an id out of range is an IndexError,
    not a read past the table."""
    kern = _kernel(None)
    n, k = 50, 512
    wq, w = _kblocks(type_name, n, k, 4) if type_name in K_TYPES else _weight(type_name, n, k, 4)
    ids = torch.tensor([[7, 0, 49], [7, 3, 12]])
    got = kern.embed(wq, type_name, k, ids)
    assert got.shape == (2, 3, k) and got.dtype == torch.float32
    assert np.array_equal(got.numpy().astype(np.float64), w[ids.numpy()])
    assert np.array_equal(kern.embed(wq, type_name, k, torch.arange(n)).numpy(), w)
    for bad in (n, -1):
        with pytest.raises(IndexError):
            kern.embed(wq, type_name, k, torch.tensor([1, bad]))


@pytest.mark.parametrize("type_name", K_TYPES)
def test_simple_k_encoder_round_trip(type_name):
    """tests/gguf_files.quantize_k (the end-to-end test's encoder) writes blocks that
    gguf.quants reads back to the input within the format's step."""
    from gguf_files import quantize_k

    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    back = quants.dequantize(quantize_k(w, type_name), gguf.GGMLQuantizationType[type_name])
    assert np.abs(back - w).mean() < {"Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}[type_name]


def _q4_k_m_like(name: str, shape: tuple[int, ...]) -> str:
    """A Q4_K_M-style mix for SmolLM2 (hidden 576, not a multiple of 256): what llama.cpp's
    quantizer does there, per tensor: ffn_down (rows of 1536) in Q4_K or (some layers) Q6_K;
    the 576-wide tensors fall back to 32-value types (its Q5_0 for Q4_K, Q8_0 for Q6_K; Q4_1
    here for q/k/o/gate/up, which the kernels run, attn_v Q8_0, so each fused qkv mixes two
    types); the token table Q8_0."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name.endswith("ffn_down.weight"):
        return "Q6_K" if layer % 3 == 0 else "Q4_K"
    if name.endswith("attn_v.weight"):
        return "Q8_0"
    return "Q8_0" if name == "token_embd.weight" else "Q4_1"


def test_q4_k_m_like_end_to_end(tmp_path, monkeypatch):
    """SmolLM2 re-encoded with the mix above: the loader keeps ffn_down in Q4_K / Q6_K, the
    mixed-type qkv as its two parts' blocks, gate_up and o in Q4_1, and the Q8_0 table quantized
    (lookups and the tied head on its blocks, no float table). A prefill's logits are the
    dequantized model's to float rounding (FLOAT_LOGITS: above the first row bucket the
    projections run F.linear on the kernel's dequantized blocks) and the head's own x
    rounding on Q8_0 (`prefill_error`), and batch-1 decode (the integer kernel) follows it
    for the first greedy tokens."""
    from gguf_files import requantize_mixed, smollm2_path

    from kvserve import LLM, SamplingParams
    from kvserve.layers import kernel_choice

    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=4")  # prefills on the dequantized copy

    if qgemv.load() is None:
        pytest.skip("no C++ compiler")
    path = requantize_mixed(smollm2_path(), tmp_path / "smollm2.q4_k_m.gguf", _q4_k_m_like)
    args = dict(model=str(path), dtype="float32", max_model_len=128, seed=0, max_num_seqs=4)
    quant, dense = LLM(quantization="gguf", **args), LLM(quantization="none", **args)
    model = quant.engine.model
    for i, layer in enumerate(model.layers):
        types = {a: w.type_name for a, w in layer.quant_weights.items()}
        assert types == {"qkv_proj": "Q4_1+Q8_0", "o_proj": "Q4_1", "gate_up_proj": "Q4_1",
                         "down_proj": "Q6_K" if i % 3 == 0 else "Q4_K"}, (i, types)
        qkv = layer.quant_weights["qkv_proj"]  # q/k Q4_1 + v Q8_0: one part per type
        assert [p.n for p in qkv.parts] == [layer.qk_size, layer.num_kv_heads * layer.head_dim]
        # the K-quants in row tiles where the build has a tile kernel for them: AVX-512 VNNI's
        # (qtiles_k.h) or, where the build has AVX2 with FMA and F16C, AVX2's (qtiles_k_avx2.h)
        assert layer.quant_weights["down_proj"].tiled == (_expected_tiles()
                                                    or _expected_native_isa() != "C++")
    assert model.quant_embed is model.quant_head and model.quant_embed.type_name == "Q8_0"
    assert model.embed_tokens.weight is None  # no float table
    assert model.gemm_plan.kernels["head"] == ["quant-fx"] * len(model.gemm_plan.kernels["head"])
    err, allowed = prefill_error(quant, dense,
                                 [quant.engine.tokenizer.encode(p) for p in PLAIN[:4]])
    assert err <= allowed
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    ta = [o.outputs[0].token_ids[:3] for o in quant.generate(PLAIN[:4], sp, use_tqdm=False)]
    tb = [o.outputs[0].token_ids[:3] for o in dense.generate(PLAIN[:4], sp, use_tqdm=False)]
    assert ta == tb


@pytest.mark.parametrize("head_type", ["Q6_K", "Q4_K"])
def test_untied_k_quant_head_is_kept_alone(tmp_path, head_type):
    """An untied LM head in a K-quant (an 8B Q4_K_M file's output.weight is Q6_K) stays as
    its blocks alone, at every row bucket: no float copy (it was 806 MB at 8B), the weight
    count says so, and its logits are the file's dequantized head (gguf.quants) times the
    hidden states, within the 8-bit activation bound."""
    from gguf_files import gguf_from_checkpoint, requantize_mixed

    from kvserve import LLM
    from kvserve.model_loader.make_model import make_model
    from kvserve.model_loader.weight_bytes import weight_bytes

    if qgemv.load() is None:
        pytest.skip("no C++ compiler")
    src = make_model(tmp_path / "llama", "llama", "small", seed=3)  # untied, hidden 512
    f32 = gguf_from_checkpoint(src, tmp_path / "f32.gguf")
    path = requantize_mixed(f32, tmp_path / "head.gguf",
                            lambda name, shape: head_type if name == "output.weight" else "F32")
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2)
    model = llm.engine.model
    assert model.lm_head.weight is None and model.quant_head.type_name == head_type
    assert set(model.gemm_plan.kernels["head"]) == {"quant"}
    counted = weight_bytes(model)
    assert counted.quantized == model.quant_head.nbytes and counted.types == (head_type,)
    reader = gguf.GGUFReader(str(path))
    out = next(t for t in reader.tensors if t.name == "output.weight")
    w = quants.dequantize(out.data, out.tensor_type).astype(np.float64)
    h = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    for rows in (1, 5):  # the decode bucket and a prefill's
        got = model.compute_logits(h[:rows]).double().numpy()
        x = h[:rows].numpy()
        assert (np.abs(got - x.astype(np.float64) @ w.T) <= _bound(x, w)).all(), rows
