"""The CPU paged decode kernel (kvserve/model/attention/cpu_paged.py) against a plain-PyTorch
paged attention (tests/reference_attention.py) and against the backend's gather path.

Block tables are scattered and lengths cross block boundaries (and stop mid-block), so a kernel
that read the wrong block, the wrong KV head for a query head, or past a sequence's end fails.
End-to-end agreement with transformers through the kernel is in test_model_parity.py
(`test_paged_backend_prefill_chunk_and_decode`) and test_engine_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import pool_over
from reference_attention import reference_paged_attention

from kvserve.model.attention import cpu_paged
from kvserve.model.attention.base import AttentionMetadata, SequenceSlice
from kvserve.model.attention.torch_backend import TorchAttentionBackend

kernel = cpu_paged.load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="paged decode kernel could not be built")


def _case(dtype, h, hkv, d, bs, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    k = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[used: used + need])
        used += need
    q = torch.randn(len(lens), h, d, generator=g)
    return q, k, v, tables


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h,hkv,d,bs", [(8, 2, 64, 16), (4, 4, 32, 4), (6, 1, 16, 8)],
                         ids=["gqa", "mha", "mqa"])
def test_kernel_matches_reference(dtype, h, hkv, d, bs):
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 37]
    q, k, v, tables = _case(dtype, h, hkv, d, bs, lens)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = kernel(q, k, v, table_t, torch.tensor(lens), 0.125)
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1], k, v, tables[i], n, 0.125)[0]
        torch.testing.assert_close(out[i], ref, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_kernel_reads_strided_queries():
    """q as the model hands it over: a view into the fused [T, H + Hkv, D] q/k tensor."""
    lens = [9, 30]
    q, k, v, tables = _case(torch.float32, 8, 2, 16, 4, lens, seed=3)
    qk = torch.randn(2, 10, 16)
    qk[:, :8] = q
    table_t = torch.tensor([t + [0] * (8 - len(t)) for t in tables])
    out = kernel(qk[:, :8], k, v, table_t, torch.tensor(lens), 0.25)
    torch.testing.assert_close(out, kernel(q, k, v, table_t, torch.tensor(lens), 0.25))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_kernel_matches_gather_path(dtype):
    """One decode step through TorchAttentionBackend with the kernel and with the gather path
    (the pure-PyTorch fallback): same output, same cache writes."""
    h, hkv, d, bs = 8, 2, 32, 4
    lens = [3, 4, 17, 40]
    q, k, v, tables = _case(dtype, h, hkv, d, bs, lens, seed=5)
    new_k = torch.randn(len(lens), hkv, d).to(dtype)
    new_v = torch.randn(len(lens), hkv, d).to(dtype)
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    decodes = [SequenceSlice(i, 1, n, tables[i]) for i, n in enumerate(lens)]
    meta = AttentionMetadata(torch.tensor(slots), [], decodes, 0)
    outs = []
    for use_kernel in (True, False):
        caches = [(k.clone(), v.clone())]
        pool = pool_over(caches)
        pool.layers = caches  # keep the test's dtype (pool_over describes fp32 storage)
        backend = TorchAttentionBackend(pool, 0.2)
        assert backend.paged_kernel is not None
        if not use_kernel:
            backend.paged_kernel = None
        outs.append(backend.bind(meta)(0, q.to(dtype), new_k, new_v))
        assert torch.equal(caches[0][0].view(-1, hkv, d)[slots], new_k)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=0)


def test_unsupported_caches_fall_back():
    """float16 (and any quantized storage) keeps the gather path."""
    assert not cpu_paged.PagedDecodeKernel.supports(torch.zeros(4, 16, 2, 8,
                                                                dtype=torch.float16))
    assert not cpu_paged.PagedDecodeKernel.supports(torch.zeros(4, 16, 2, 8,
                                                                dtype=torch.int8))
    assert cpu_paged.PagedDecodeKernel.supports(torch.zeros(4, 16, 2, 8))
