"""The quantized linear layers (issue 31): the C++ kernel on GGUF Q8_0/Q4_0/Q4_1 blocks
(kernels/cpu/qgemv.py) against PyTorch on the weights `gguf.quants` dequantizes, in each of
its instruction-set paths, and the engine on the default Q4_1 model with quantization="gguf"
against the dequantized float32 path.

The kernel quantizes each row of x to 8-bit blocks of 32 (scale d = amax / 127, values
rounded to nearest), so its products differ from x W^T by the activation error alone: each
x_i moves by at most d_b / 2 (d_b of its block), hence

    |y_o - (x W^T)_o| <= sum_b d_b / 2 * sum_{i in b} |W_oi|   (+ float32 rounding)

which `_bound` computes; against the same quantization of x done here in numpy the kernel
agrees to float32 rounding of the accumulation (relative 1e-5 of sum |x||W|)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from kvserve.kernels.cpu import cpu_ext, qgemv
from kvserve.layers import kernel_choice

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# (label, -march): the build's own (VNNI where this CPU has it), AVX2 without VNNI (an EPYC of
# issue 18; kvserve's KVSERVE_CPU_ISA=avx2 cap builds the same), and plain x86-64 (SSE2: the
# C++ loop)
ISAS = (("native", None), ("avx2", "x86-64-v3"), ("plain", "x86-64"))


def _cpu_has(flag: str) -> bool:
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return flag in cpu_info().flags


def _expected_native_isa() -> str:
    """The path the default build must take on this CPU (cpu_info hides what a
    KVSERVE_CPU_ISA cap takes away): VNNI where AVX-512 VNNI with VL or AVX-VNNI is there,
    else AVX2 (with FMA and F16C), else the C++ loop."""
    if (_cpu_has("avx512_vnni") and _cpu_has("avx512vl")) or _cpu_has("avx_vnni"):
        return "VNNI"
    return "AVX2" if all(_cpu_has(f) for f in ("avx2", "fma", "f16c")) else "C++"


def _expected_tiles() -> bool:
    """Whether the default build must have the AVX-512 VNNI row-tile kernel on this CPU
    (qtiles.h's KVQ_TILE512: AVX-512 F, BW and VNNI; cpu_info hides what a KVSERVE_CPU_ISA
    cap takes away), so that quantized weights are held as tiles."""
    return all(_cpu_has(f) for f in ("avx512f", "avx512bw", "avx512_vnni"))


def _kernel(march: str | None) -> qgemv.QGemv:
    if march is None:
        k = qgemv.load()
    else:
        if march == "x86-64-v3" and not _cpu_has("avx2"):
            pytest.skip("no AVX2 on this CPU")
        flags = tuple(f"-march={march}" if f.startswith("-march=") else f
                      for f in cpu_ext.CXXFLAGS)
        lib = cpu_ext.load_library(qgemv.SOURCE, flags)
        k = None if lib is None else qgemv.QGemv(lib)
    if k is None:
        pytest.skip("no C++ compiler")
    return k


def _weight(type_name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(blocks as uint8 [n, row bytes], the float64 weight gguf.quants dequantizes them to)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qt = getattr(gguf.GGMLQuantizationType, type_name)
    raw = quants.quantize(w, qt)
    return (torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).view(n, -1),
            quants.dequantize(raw, qt).astype(np.float64))


def _quantized_x(x: np.ndarray, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """x's rows as the kernel quantizes them (float32 steps as in qgemv.cpp): (dequantized
    x as float64, per-block scales [rows, k / 32]); `group` blocks of 32 share one scale (8:
    the AVX2 K-quant rows)."""
    b = x.reshape(x.shape[0], -1, 32 * group).astype(np.float32)
    d = (np.abs(b).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[..., None])
    return ((q * d[..., None].astype(np.float64)).reshape(x.shape),
            np.repeat(d.astype(np.float64), group, axis=1))


def _bound(x: np.ndarray, w: np.ndarray, group: int = 1) -> np.ndarray:
    """The activation-quantization bound above, [rows, n], plus float32 rounding."""
    _, d = _quantized_x(x, group)
    wb = np.abs(w).reshape(w.shape[0], -1, 32).sum(axis=2)  # [n, blocks]
    rounding = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    return d / 2 @ wb.T + rounding


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 37])
def test_kernel_matches_reference(isa, type_name, rows):
    kern = _kernel(isa[1])
    assert kern.isa == {"avx2": "AVX2", "plain": "C++"}.get(isa[0], _expected_native_isa())
    n, k = 67, 32 * 19  # k not a multiple of 256 (no super-blocks), n not of 4
    wq, w = _weight(type_name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kern.linear(x, wq, type_name, k).double().numpy()
    xn = x.numpy()
    exact = xn.astype(np.float64) @ w.T
    assert (np.abs(y - exact) <= _bound(xn, w)).all()
    xq, _ = _quantized_x(xn)  # the same quantization of x: only float rounding is left
    tight = 1e-5 * (np.abs(xn).astype(np.float64) @ np.abs(w).T) + 1e-6
    assert (np.abs(y - xq @ w.T) <= tight).all()


@pytest.mark.parametrize("isa", ISAS[:2], ids=[i[0] for i in ISAS[:2]])
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_epilogues(isa, type_name):
    """The residual add, the bias and the gated activations (SiLU, GELU-tanh) of [gate; up],
    each against its float64 reference on the kernel's own product (mode 0)."""
    kern = _kernel(isa[1])
    inter, k, rows = 40, 32 * 9, 3
    wq, _ = _weight(type_name, 2 * inter, k, seed=7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(2 * inter, generator=g)
    plain = kern.linear(x, wq, type_name, k).double()
    with_bias = kern.linear(x, wq, type_name, k, bias).double()
    torch.testing.assert_close(with_bias, plain + bias.double(), rtol=1e-6, atol=1e-5)
    residual = torch.randn(rows, 2 * inter, generator=g)
    expect = residual.double() + plain
    kern.linear(x, wq, type_name, k, mode=qgemv.MODE_ADD, out=residual)
    torch.testing.assert_close(residual.double(), expect, rtol=1e-6, atol=1e-5)
    gate, up = plain[:, :inter], plain[:, inter:]
    silu = kern.linear(x, wq, type_name, k, mode=qgemv.MODE_SILU_MUL).double()
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate) * up, rtol=1e-5,
                               atol=1e-5)
    gelu = kern.linear(x, wq, type_name, k, mode=qgemv.MODE_GELU_MUL).double()
    torch.testing.assert_close(gelu, torch.nn.functional.gelu(gate, approximate="tanh") * up,
                               rtol=1e-5, atol=1e-5)
    # the bound ops (one pointer a call) are the same calls
    assert torch.equal(kern.bind(wq, type_name, k, bias)(x), with_bias.float())
    assert torch.equal(kern.bind(wq, type_name, k, mode=qgemv.MODE_SILU_MUL)(x), silu.float())
    residual = torch.zeros(rows, 2 * inter)
    kern.bind(wq, type_name, k, mode=qgemv.MODE_ADD)(x, residual)
    assert torch.equal(residual, plain.float())


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_quants(type_name):
    kern = _kernel(None)
    wq, w = _weight(type_name, 33, 32 * 7, seed=11)
    assert np.array_equal(kern.dequantize(wq, type_name, 32 * 7).numpy().astype(np.float64), w)


def test_kernel_refuses_bad_weights():
    kern = _kernel(None)
    wq, _ = _weight("Q4_1", 8, 64, seed=1)
    with pytest.raises(ValueError, match="Q4_1 weight"):
        kern.linear(torch.randn(1, 64), wq[:, :-1].contiguous(), "Q4_1", 64)
    with pytest.raises(ValueError, match="no kernel"):
        kern.linear(torch.randn(1, 64), wq, "Q2_K", 64)


# -- the engine on the default model (SmolLM2-135M, Q4_1 projections, Q8_0 embedding) -------
PLAIN = [
    "The capital of France is",
    "def reverse_string(s):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\ndef mean(xs):",
    "Water boils at a temperature of",
    "Here is a haiku about the sea:",
    "The quick brown fox jumps over",
]

# Float rounding between two float32 paths of the same weights: the dequantized model's
# measured plan (panel GEMM, GEMV) is up to 1.5e-4 from float64 on this model (test_gguf.py),
# F.linear here within 1e-4 of it: their difference within the sum of both.
FLOAT_LOGITS = 2.5e-4


def _head_allowance(head, h: torch.Tensor, table: torch.Tensor) -> float:
    """The LM head's own activation rounding on the final hidden states h [rows, k] over the
    (dequantized) table, as the kernel tests bound it: 8-bit x blocks (`_bound`) on the
    integer kernel; on the float-x kernel (Q8_0), none for the file's rows (x stays float32)
    and 16-bit blocks for row tiles (scale amax / 32767, test_quant_tiles); plus float32
    rounding of the products."""
    hn = h.double().numpy()
    w = table.double()
    wb = w.abs().view(w.shape[0], -1, 32).sum(-1).numpy()
    rounding = 1e-5 * float((h.abs().double() @ w.abs().T).max())
    if head.float_x:
        if not head.weight.tiled:
            return rounding
        d = np.abs(hn.reshape(hn.shape[0], -1, 32)).max(axis=2) / 32767
    else:
        _, d = _quantized_x(h.numpy())
    return float((d / 2 @ wb.T).max()) + rounding


def prefill_error(quant, dense, prompts: list[list[int]]) -> tuple[float, float]:
    """(the largest difference of the first-token logits between the quantized engine and
    the dequantized one, the bound it must keep): FLOAT_LOGITS where every projection runs
    F.linear on the dequantized blocks, plus the head's own activation rounding
    (`_head_allowance`) on the hidden states it was given."""
    from helpers import first_token_logits

    from kvserve.layers.buckets import bucket_of

    model = quant.engine.model
    hidden = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (hidden.append(h.clone()), compute_logits(h))[1]
    try:
        a = first_token_logits(quant, [prompts])
    finally:
        del model.compute_logits
    b = first_token_logits(dense, [prompts])
    err = max((a[tuple(p)] - b[tuple(p)]).abs().max().item() for p in prompts)
    table = dense.engine.model.embed_tokens.weight.detach()
    return err, FLOAT_LOGITS + max(
        _head_allowance(model.head.buckets[bucket_of(h.shape[0])], h, table) for h in hidden)


@pytest.fixture(scope="module")
def engines():
    from gguf_files import smollm2_path

    from kvserve import LLM

    if qgemv.load() is None:
        pytest.skip("no C++ compiler")
    # max_num_seqs=4: every decode step is in the first row bucket, the integer kernel's;
    # KVSERVE_KERNEL=qrows=4: a prefill on the dequantized copy (the exactness test below)
    args = dict(model=str(smollm2_path()), dtype="float32", max_model_len=256, seed=0,
                max_num_seqs=4)
    saved = os.environ.get(kernel_choice.KERNEL_ENV)
    os.environ[kernel_choice.KERNEL_ENV] = "qrows=4"
    try:
        return LLM(quantization="gguf", **args), LLM(quantization="none", **args)
    finally:
        if saved is None:
            del os.environ[kernel_choice.KERNEL_ENV]
        else:
            os.environ[kernel_choice.KERNEL_ENV] = saved


def test_engine_keeps_the_blocks(engines):
    quant, dense = engines
    model = quant.engine.model
    assert model.gemm_plan.source == "quantized"
    for layer in model.layers:
        assert set(layer.quant_weights) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        assert {w.type_name for w in layer.quant_weights.values()} == {"Q4_1"}
        # no float copies
        assert layer.qkv_proj.weight is None and layer.gate_up_proj.weight is None
    assert model.quant_head.type_name == "Q8_0"  # x kept in float there (QuantizedHead)
    assert model.quant_head.tiled == _expected_tiles()  # 16-bit x on tiles (prefill_error)
    assert model.gemm_plan.kernels["head"][0] == "quant-fx"
    assert dense.engine.model.gemm_plan.source != "quantized"


def test_prefill_runs_the_file_weights_exactly(engines):
    """Above the first row bucket (with KVSERVE_KERNEL=qrows=4, the fixture's) the projections
    run F.linear on the blocks dequantized by the kernel, so a prefill's logits are the
    dequantized model's up to float rounding (FLOAT_LOGITS) and the Q8_0 head's 16-bit x on
    row tiles (`prefill_error`): the blocks were placed (q, k, v fused; gate, up fused;
    llama.cpp's q/k row permutation undone) as dequantize places the floats."""
    quant, dense = engines
    err, allowed = prefill_error(quant, dense, [quant.engine.tokenizer.encode(p) for p in PLAIN])
    assert err <= allowed


def test_decode_agrees_with_the_dequantized_model(engines):
    """Batch-1 decode on the integer kernel (x quantized to 8 bits per block of 32, as
    llama.cpp runs these formats) against the dequantized float32 model, 16 greedy tokens on 8
    prompts (the LM head with x in float32 in both). Measured on this model: the logprobs
    of the agreed tokens within 0.13 of each other, every prompt's first 8 tokens equal and 5
    of 8 prompts equal for 16 tokens (the others part at a near-tie of the top two tokens).
    The bounds below leave a margin over that: the kernel's own error is bounded exactly by
    the tests above; these catch a wiring fault (a misplaced block or a wrong epilogue
    changes the text from the first token)."""
    from kvserve import SamplingParams

    quant, dense = engines
    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0)
    a = [o.outputs[0] for o in quant.generate(PLAIN, sp, use_tqdm=False)]
    b = [o.outputs[0] for o in dense.generate(PLAIN, sp, use_tqdm=False)]
    same_all, worst = 0, 0.0
    for x, y in zip(a, b):
        n = 0
        while n < len(x.token_ids) and x.token_ids[n] == y.token_ids[n]:
            n += 1
        assert n >= 3, (x.text, y.text)
        same_all += n == len(x.token_ids)
        for i in range(n):
            t = x.token_ids[i]
            worst = max(worst, abs(x.logprobs[i][t] - y.logprobs[i][t]))
    assert same_all >= 4
    assert worst <= 0.3


def test_quantization_option():
    """None (the default) keeps the blocks for a float32 model on the CPU and dequantizes
    elsewhere; "gguf" anywhere the kernels cannot run is a clear error, not a silent float
    model; an unknown name is refused."""
    from kvserve.layers.selection import keeps_gguf_blocks
    from kvserve.model_loader.loader import DEFAULT_QUANTIZATION
    from kvserve.worker.model_build import load_model

    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def keeps(quantization, dtype, device):
        return keeps_gguf_blocks(quantization, dtype, device, DEFAULT_QUANTIZATION)

    assert keeps(None, torch.float32, cpu) == (DEFAULT_QUANTIZATION == "gguf")
    assert not keeps(None, torch.bfloat16, cpu)
    assert not keeps(None, torch.float32, cuda)
    assert not keeps("none", torch.float32, cpu)
    with pytest.raises(ValueError, match="CPU in float32 only"):
        keeps("gguf", torch.float32, cuda)
    with pytest.raises(ValueError, match="CPU in float32 only"):
        keeps("gguf", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model("/nonexistent", quantization="q3_k")


@pytest.mark.parametrize("isa", ISAS, ids=[i[0] for i in ISAS])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_float_x_q8_0(isa, rows):
    """The LM head's path: x kept in float32, Q8_0 widened in registers: only float32
    rounding of the sums is left (relative 1e-5 of sum |x||W|), no activation error."""
    kern = _kernel(isa[1])
    n, k = 53, 32 * 19
    wq, w = _weight("Q8_0", n, k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    y = kern.linear(x, wq, "Q8_0", k, float_x=True).double().numpy()
    xn = x.numpy().astype(np.float64)
    assert (np.abs(y - xn @ w.T) <= 1e-5 * (np.abs(xn) @ np.abs(w).T) + 1e-6).all()
    residual = torch.ones(rows, n)
    kern.linear(x, wq, "Q8_0", k, mode=qgemv.MODE_ADD, out=residual, float_x=True)
    torch.testing.assert_close(residual.double().numpy(), y + 1, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="float x"):
        q4, _ = _weight("Q4_1", n, k, seed=5)
        kern.linear(x, q4, "Q4_1", k, float_x=True)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q5_0", "Q5_1"])
def test_other_block_types_end_to_end(type_name, tmp_path, monkeypatch):
    """The default model's weights re-encoded as Q4_0 / Q8_0 / Q5_0 / Q5_1 (every 2-D tensor,
    the tied table too, which stays quantized: lookups and the head read its blocks): the
    loader keeps the projections in that type, a prefill's logits are the dequantized model's
    (float rounding, FLOAT_LOGITS; plus the head's own activation rounding, `prefill_error`:
    8-bit x on Q4_0 / Q5_0 / Q5_1, 16-bit x on Q8_0 tiles), and batch-1 decode follows it
    for the first greedy tokens."""
    from gguf_files import requantize, smollm2_path

    from kvserve import LLM, SamplingParams

    if qgemv.load() is None:
        pytest.skip("no C++ compiler")
    path = requantize(smollm2_path(), tmp_path / f"smollm2.{type_name}.gguf", type_name)
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "qrows=4")  # prefills on the dequantized copy
    args = dict(model=str(path), dtype="float32", max_model_len=128, seed=0, max_num_seqs=4)
    quant, dense = LLM(quantization="gguf", **args), LLM(quantization="none", **args)
    model = quant.engine.model
    assert {w.type_name for w in model.layers[0].quant_weights.values()} == {type_name}
    assert model.quant_embed is model.quant_head and model.embed_tokens.weight is None
    head = model.gemm_plan.kernels["head"]
    assert head == ["quant-fx" if type_name == "Q8_0" else "quant"] * len(head)
    err, allowed = prefill_error(quant, dense,
                                 [quant.engine.tokenizer.encode(p) for p in PLAIN[:4]])
    assert err <= allowed
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    ta = [o.outputs[0].token_ids[:3] for o in quant.generate(PLAIN[:4], sp, use_tqdm=False)]
    tb = [o.outputs[0].token_ids[:3] for o in dense.generate(PLAIN[:4], sp, use_tqdm=False)]
    assert ta == tb
