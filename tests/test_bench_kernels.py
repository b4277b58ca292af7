"""`kvserve bench kernels` (kvserve/bench/kernels.py, kernel_cases.py): every --kernel runs on a
tiny shape and returns timings of the right structure, and where a kernel has a reference
(F.linear, gguf-py's dequantization, torch's SDPA, the F.linear model) the benchmark's own
check fails when a path is fed a wrong result, so that check is real."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.bench import kernels
from kvserve.entrypoints.cli import build_parser

pytestmark = pytest.mark.timeout(300)

TINY = {
    "gemv": ["--rows", "1,3", "--layers", "1"],
    "qgemm": ["--rows", "1,5", "--types", "Q8_0"],
    "attention": ["--cases", "2x40,1x70", "--query-rows", "1,3", "--layers", "2"],
    "forward": ["--arch", "qwen2", "--tokens", "8"],
    "step": ["--running", "8", "--steps", "12"],
    "sampler": ["--batch", "8", "--fraction", "0.5"],
}
PATHS = {"gemv": {"mkl", "gemv"}, "qgemm": {"tiled", "dequant"}, "attention": {"paged", "sdpa"},
         "forward": {"F.linear"}, "step": {"step", "pickle"}, "sampler": {"plain", "masked"}}


def bench(kernel: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / f"{kernel}.json"
    args = build_parser().parse_args(["bench", "kernels", "--kernel", kernel, "--repeats", "2",
                                      "--threads", "1", "--output-json", str(out),
                                      *TINY[kernel], *extra])
    result = kernels.run(args)
    assert json.loads(out.read_text())["kernel"] == kernel
    return result


def kernel_available(kernel: str) -> bool:
    from kvserve.attention import cpu_paged
    from kvserve.kernels.cpu import gemv, qgemv

    return {"gemv": lambda: gemv.load() is not None, "qgemm": lambda: qgemv.load() is not None,
            "attention": lambda: cpu_paged.load_kernel() is not None}.get(kernel, lambda: True)()


@pytest.mark.parametrize("kernel", kernels.KERNELS)
def test_each_kernel_times_its_paths(kernel, tmp_path):
    if not kernel_available(kernel):
        pytest.skip(f"the {kernel} kernel does not build here")
    result = bench(kernel, tmp_path)
    assert result["threads"] == 1 and "flags:" in result["cpu"]
    cases = [c for c in result["cases"] if "read" not in c["paths"]]
    expected = {"gemv": 2, "qgemm": 4 * 2, "attention": 2 * 2, "forward": 2, "step": 1,
                "sampler": 2 * 2}
    assert len(cases) == expected[kernel]
    for case in cases:
        assert PATHS[kernel] <= set(case["paths"])
        for timing in case["paths"].values():
            assert 0 < timing["min_ms"] <= timing["median_ms"] < 60_000
        if kernel not in ("step", "sampler"):  # every path checked against the reference
            assert set(case["max_abs_err"]) == set(case["paths"])


def _wrong(fn):
    """`fn`, its result off by a little more than any tolerance."""
    def wrong(*a, **k):
        out = fn(*a, **k)
        out.add_(0.5) if isinstance(out, torch.Tensor) else None
        return out
    return wrong


@pytest.mark.parametrize("kernel,cls,method,path", [("gemv", "Gemv", "linear", "gemv"),
                                                    ("qgemm", "BoundQGemv", "__call__", "tiled")])
def test_gemm_check_catches_a_wrong_kernel(tmp_path, monkeypatch, kernel, cls, method, path):
    from kvserve.kernels.cpu import gemv, qgemv

    module = gemv if kernel == "gemv" else qgemv
    if module.load() is None:
        pytest.skip(f"no {kernel} kernel here")
    monkeypatch.setattr(getattr(module, cls), method, _wrong(getattr(getattr(module, cls), method)))
    with pytest.raises(kernels.CheckError, match=path):
        bench(kernel, tmp_path)


def test_qgemm_reference_is_gguf_py():
    """The reference weights are gguf-py's dequantization of the blocks the kernel reads:
    Q8_0's blocks hold the value / scale rounded, so they are within half a scale step."""
    data, ref = kernels.quant_weight("Q8_0", 4, 64)
    assert data.dtype == torch.uint8 and ref.shape == (4, 64)
    import numpy as np

    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 0.05
    step = np.abs(w.reshape(4, 2, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(w.reshape(4, 2, 32) - ref.numpy().reshape(4, 2, 32)) <= step).all()


def test_attention_check_catches_a_wrong_kernel(tmp_path, monkeypatch):
    from kvserve.attention import cpu_paged

    if cpu_paged.load_kernel() is None:
        pytest.skip("the paged decode kernel does not build here")
    original = cpu_paged.PagedStep.run

    def drops_a_block(self, q, kv, scale, out=None, *a):
        res = original(self, q, kv, scale, out, *a)
        res[0].mul_(0.5)  # one row wrong, as a kernel that lost a block would be
        return res

    monkeypatch.setattr(cpu_paged.PagedStep, "run", drops_a_block)
    with pytest.raises(kernels.CheckError, match="paged"):
        bench("attention", tmp_path)


def test_attention_reference_is_attention():
    """The SDPA reference over gathered blocks equals softmax(q k^T / sqrt(d)) v written out
    for one row over its own context."""
    from kvserve.bench.kernel_cases import BLOCK, AttentionCase

    c = AttentionCase(2, 37, 2, 1, heads=4, kv_heads=2, dim=8, dtype=torch.float32)
    got = c.sdpa(0)
    row = 3  # sequence 1, its second row: it sees 38 tokens
    n = int(c.lens[row])
    k, v = (x[c.tables[row]].reshape(-1, 2, 8)[:n] for x in c.kv[0])
    for h in range(4):
        w = torch.softmax(c.q[row, h] @ k[:, h // 2].T * 8 ** -0.5, dim=0)
        torch.testing.assert_close(got[row, h], w @ v[:, h // 2], atol=1e-5, rtol=1e-5)
    assert n == 38 and c.tables.shape[1] * BLOCK >= n


def test_forward_check_catches_a_wrong_packed_model(tmp_path, monkeypatch):
    from kvserve.layers.cpu_linear import onednn_available
    from kvserve.worker import model_build

    if not onednn_available(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN packing here: the forward kernel has one path")
    # The packed path this test checks, whatever this CPU's measured plan would pick (on an
    # Ice Lake Xeon MKL won every bucket, nothing was packed and the check had nothing to catch)
    monkeypatch.setenv("KVSERVE_KERNEL", "onednn")
    load = model_build.load_model

    def wrong_when_packed(path, dtype, pack_weights=True, **kw):
        model, *rest = load(path, dtype, pack_weights=pack_weights, **kw)
        if pack_weights:
            model.forward = _wrong(model.forward)
            model.compute_logits = _wrong(model.compute_logits)
        return (model, *rest)

    monkeypatch.setattr(model_build, "load_model", wrong_when_packed)
    with pytest.raises(kernels.CheckError, match="packed"):
        bench("forward", tmp_path)


def test_check_passes_within_and_fails_past_the_tolerance():
    x = torch.ones(3, 4)
    assert kernels.check("same", x + 1e-6, x, atol=1e-4) < 1e-4
    with pytest.raises(kernels.CheckError, match="max abs error"):
        kernels.check("off", x + 1e-2, x, atol=1e-4)
    with pytest.raises(kernels.CheckError, match="shape"):
        kernels.check("shape", torch.ones(3, 5), x, atol=1.0)


def test_sampler_check_catches_a_sampler_that_ignores_the_bitmask(tmp_path, monkeypatch):
    """The check reads the bitmask's bits itself: a sampler that drops the grammar's mask
    picks tokens it forbids (random bitmasks forbid about half the vocabulary)."""
    from kvserve.sampler import Sampler

    original = Sampler.__call__

    def unmasked(self, logits, rows, token_bitmask=None):
        allow_all = None if token_bitmask is None else torch.full_like(token_bitmask, -1)
        return original(self, logits, rows, allow_all)

    monkeypatch.setattr(Sampler, "__call__", unmasked)
    with pytest.raises(kernels.CheckError, match="disallowed"):
        bench("sampler", tmp_path)
