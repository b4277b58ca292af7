"""The CPU paged decode kernel (kvserve/attention/cpu_paged.py) against a plain-PyTorch
paged attention (tests/reference_attention.py) and against the backend's gather path.

Block tables are scattered and lengths cross block boundaries (and stop mid-block), so a kernel
that read the wrong block, the wrong KV head for a query head, or past a sequence's end fails.
End-to-end agreement with transformers through the kernel is in test_model_parity.py
(`test_paged_backend_prefill_chunk_and_decode`) and test_engine_parity.py.
"""

from __future__ import annotations

import platform

import pytest
import torch
from helpers import pool_over
from reference_attention import reference_paged_attention

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.spec import KVStorage, decoder_kv_spec
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention import cpu_paged
from kvserve.attention.base import AttentionMetadata, SequenceSlice
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kernels.cpu.cpu_ext import CXXFLAGS, load_library

kernel = cpu_paged.load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="paged decode kernel could not be built")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The kernel shares out one sequence per work item when it has >= 4 sequences per thread,
    else one (sequence, KV head) pair: the tests' six sequences take the first path on one
    thread and the second on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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
@pytest.mark.parametrize("h,hkv,d,bs", [(8, 2, 64, 16), (4, 4, 32, 4), (6, 1, 16, 8),
                                        (6, 2, 40, 48), (10, 2, 24, 20), (8, 2, 128, 16),
                                        (4, 4, 128, 32)],
                         ids=["gqa", "mha", "mqa", "gqa3-d40-bs48", "gqa5-d24-bs20",
                              "gqa-d128", "mha-d128-bs32"])
def test_kernel_matches_reference(dtype, h, hkv, d, bs, threads):
    _check_against_reference(kernel, dtype, h, hkv, d, bs)


def _check_against_reference(k_fn, dtype, h, hkv, d, bs):
    """Lengths around the block size and past several blocks, scattered tables."""
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 37]
    q, k, v, tables = _case(dtype, h, hkv, d, bs, lens)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = k_fn(q, k, v, table_t, torch.tensor(lens), 0.125)
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1], k, v, tables[i], n, 0.125)[0]
        torch.testing.assert_close(out[i], ref, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_stores_the_new_token_then_reads_it(dtype, threads):
    """With new K/V rows the kernel stores each at its sequence's last position (as the
    backend's scatter would: same cache afterwards, nothing else touched) before attending; the
    rows are strided views of a fused [T, H + 2 Hkv, D] tensor, as the model hands them over."""
    h, hkv, d, bs = 8, 2, 32, 16
    lens = [1, bs, bs + 1, 3 * bs + 5, 37, 2]
    q, k, v, tables = _case(dtype, h, hkv, d, bs, lens, seed=11)
    fused = torch.randn(len(lens), h + 2 * hkv, d).to(dtype)
    new_k, new_v = fused[:, h: h + hkv], fused[:, h + hkv:]
    want_k, want_v = k.clone(), v.clone()
    for i, n in enumerate(lens):
        block, row = tables[i][(n - 1) // bs], (n - 1) % bs
        want_k[block, row], want_v[block, row] = new_k[i], new_v[i]
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    step = kernel.step(table_t, torch.tensor(lens))
    out = step.run(q, cpu_paged.PagedKV(cpu_paged.FLOAT_KINDS[dtype], k, v, d), 0.125,
                   new_k=new_k, new_v=new_v)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1], want_k, want_v, tables[i], n, 0.125)[0]
        torch.testing.assert_close(out[i], ref, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context", [5, 251, 700], ids=["short", "tile-edge", "threaded"])
def test_rows_of_one_sequence_read_each_others_new_tokens(dtype, context, threads):
    """A speculative verification (worker/model_runner.py's _draft_rows): five rows of one
    block table at consecutive positions, row j attending to the context and rows 0..j. Every
    row's new K/V must be stored before any row reads, also when threads share the rows out
    (700 tokens of context: past the kernel's threading threshold); the kernel reads the
    shared keys once for all five rows, and each row must still get the very bits it gets
    alone (the rows cross a chunk, a block and, from 251, a 256-token tile)."""
    h, hkv, d, bs = 9, 3, 64, 16
    rows = 5
    q, k, v, tables = _case(dtype, h, hkv, d, bs, [context + rows], seed=5)
    q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(6))
    new_k, new_v = torch.randn(rows, hkv, d).to(dtype), torch.randn(rows, hkv, d).to(dtype)
    want_k, want_v = k.clone(), v.clone()
    for j in range(rows):
        block, row = tables[0][(context + j) // bs], (context + j) % bs
        want_k[block, row], want_v[block, row] = new_k[j], new_v[j]
    lens = [context + j + 1 for j in range(rows)]
    table_t = torch.tensor(tables * rows)
    kind = cpu_paged.FLOAT_KINDS[dtype]
    out = kernel.step(table_t, torch.tensor(lens)).run(
        q, cpu_paged.PagedKV(kind, k, v, d), 0.125, new_k=new_k, new_v=new_v)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    for j, n in enumerate(lens):
        ref = reference_paged_attention(q[j: j + 1], want_k, want_v, tables[0], n, 0.125)[0]
        torch.testing.assert_close(out[j], ref, atol=2e-5, rtol=1e-5)
        alone = kernel.step(table_t[:1], torch.tensor([n])).run(
            q[j: j + 1], cpu_paged.PagedKV(kind, k, v, d), 0.125)
        assert torch.equal(out[j], alone[0]), f"row {j} differs from its decode alone"


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
    # Both against plain softmax attention over the cache as written (not only each other).
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1].to(dtype), *caches[0], tables[i], n, 0.2)[0]
        torch.testing.assert_close(outs[0][i].float(), ref, atol=tol, rtol=0)


def test_unsupported_caches_fall_back():
    """Integer tensors and caches off the CPU or beyond the kernel's buffers keep the gather
    path; the float types are read in place (`paged_kv`, what the backend asks per layer)."""
    def supports(k):
        codec = KVTensorPool.wrap(decoder_kv_spec(1, 2, k.shape[-1], KVStorage("fp32"),
                                                  k.shape[1]), [(k, k)]).codecs[0]
        return cpu_paged.paged_kv(codec, (k, k), 0) is not None

    assert not supports(torch.zeros(4, 16, 2, 8, dtype=torch.int8))
    assert not supports(torch.zeros(4, 512, 2, 8))  # block beyond MAX_BLOCK_SIZE
    assert not supports(torch.zeros(4, 16, 2, 8, 2)[..., 0])  # not contiguous
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert supports(torch.zeros(4, 16, 2, 8, dtype=dtype))


# -- quantized and float storage formats, read in place ---------------------------------------
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMATS = ["fp32", "bf16", "fp16", "fp8", "fp8_e5m2", "int8", "int4"]


def _filled_pool(name, hkv, d, bs, lens, seed=0, group_size=None):
    """A one-layer pool of format `name` holding sequences of `lens` tokens (random K/V stored
    through the pool's codec in one step, as a prefill does), their block tables (scattered
    blocks) and one spare block. fp8 gets scales other than 1 so that a kernel ignoring them
    fails."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    storage = KVStorage(name, group_size=group_size,
                        key_group_tokens=bs if name == "int4" else None)
    spec = decoder_kv_spec(1, hkv, d, storage, bs)
    scales = torch.tensor([[0.5, 2.0]]) if name in FP8 else None
    pool = KVTensorPool(spec, num_blocks, kv_scales=scales)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used, writes, slots = [], 0, [], []
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[used: used + need])
        used += need
        writes.append((tables[-1], 0, n))
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(n)]
    total = sum(lens)
    k = torch.randn(total, hkv, d, generator=g) * 2
    k[:, :, 3] += 6  # an outlier channel, as keys have
    v = torch.randn(total, hkv, d, generator=g)
    if name == "int4":  # a bf16 model: the residual rows are bf16, not the kernel's float32
        k, v = k.bfloat16(), v.bfloat16()
    step = pool.begin_step(writes, total)
    pool.store(0, k, v, torch.tensor(slots), step)
    return pool, tables, perm[used]


def _unpack(packed):
    return torch.stack([packed & 0x0F, packed >> 4], -1).flatten(-2)


def _affine(codes, sz):
    """x = code * scale + zero per group (kv/quant.py's documented formula), fp16 sz."""
    *lead, width = codes.shape
    groups = sz.shape[-2]
    c = codes.float().reshape(*lead, groups, width // groups)
    return (c * sz[..., 0:1].float() + sz[..., 1:2].float()).reshape(*lead, width)


def _dequantized(pool, name):
    """The whole layer dequantized in plain PyTorch from the formats' definitions (torch's own
    float8 casts, the affine formula, KIVI's per-channel keys and residual rows): [blocks, bs,
    Hkv, D] float32 K and V."""
    parts = pool.layers[0]
    if name in ("fp32", "bf16", "fp16"):
        return parts[0].float(), parts[1].float()
    if name in FP8:
        ks, vs = pool.scales.values[0].tolist()
        return (parts[0].view(FP8[name]).float() * ks, parts[1].view(FP8[name]).float() * vs)
    if name == "int8":
        return _affine(parts[0], parts[2]), _affine(parts[1], parts[3])
    v = _affine(_unpack(parts[1]), parts[3])
    sz = parts[2].float()  # [blocks, Hkv, D, 2]: per channel over the block's tokens
    k = _unpack(parts[0]).float() * sz[:, None, :, :, 0] + sz[:, None, :, :, 1]
    for block, row in pool.codecs[0].residual.rows.items():  # blocks still filling: exact keys
        k[block] = pool.codecs[0].residual.tensors[0][row].float()
    return k, v


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bs", [16, 5, 40])
@pytest.mark.parametrize("window", [None, 12, 300])
@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64"])
def test_kernel_reads_every_format_like_the_reference(name, bs, window, d, threads):
    """The kernel on the pool's own parts (codes and scales in place) equals softmax attention
    over K/V dequantized by the formats' definitions; GQA, sequences ending mid-block and on a
    block boundary, int8 with two scale groups per vector, int4 with the filling blocks' keys in
    the residual; a sequence of 600 tokens spans several of the kernel's tiles (whole blocks
    up to 256 tokens: 16, 51 or 6 blocks here), and a window of 300 starts inside a tile.
    With a window, the table entries wholly before it point at a block of NaN (as released
    NULL_BLOCK entries point at nothing): a kernel that read one fails. Head size 64 takes
    float32's strided path (whole chunks of rows at a stride), 32 the general one."""
    check_format_against_reference(name, 8, 2, d, bs, [1, bs - 1, bs, bs + 1, 3 * bs + 2, 41, 600],
                                   window, seed=bs)


def check_format_against_reference(name, h, hkv, d, bs, lens, window, seed):
    """Sequences of `lens` tokens in format `name` through the kernel against the reference on
    K/V dequantized by the format's definition (test_kernel_reads_every_format_like_the_
    reference, and test_paged_split.py's long contexts)."""
    pool, tables, spare = _filled_pool(name, hkv, d, bs, lens, seed=seed,
                                       group_size=16 if name in ("int8", "int4") else None)
    kd, vd = _dequantized(pool, name)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(7))
    starts = [0 if window is None else max(0, n - window) for n in lens]
    read = [[b if i >= st // bs else spare for i, b in enumerate(t)]
            for t, st in zip(tables, starts)]
    for part in pool.layers[0]:
        part[spare].view(torch.uint8).fill_(0xFF)  # NaN in every format (codes, scales)
    assert _dequantized(pool, name)[0][spare].isnan().any() or name in ("int4",)
    width = max(len(t) for t in read)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in read])
    res_rows = None
    if name == "int4":
        res_rows = torch.tensor([[pool.codecs[0].residual.rows.get(b, -1) for b in t] for t in
                                 table_t.tolist()])
    kv = cpu_paged.paged_kv(pool.codecs[0], pool.layers[0], 0)
    out = kernel(q, kv, None, table_t, torch.tensor(lens), 0.125,
                 starts=None if window is None else torch.tensor(starts), res_rows=res_rows)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1], kd, vd, tables[i], n, 0.125, window)[0]
        torch.testing.assert_close(out[i], ref, atol=3e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "bf16"])
def test_backend_decodes_through_the_kernel_like_the_gather_path(name):
    """A decode step of a one-layer sliding-window pool (window 12, block 5) with NULL_BLOCK
    entries before the window, through TorchAttentionBackend with the kernel and with the
    gather path: the same output (the kernel's dequantization equals the codec's)."""
    hkv, d, bs, window = 2, 32, 5, 12
    lens = [3, 14, 29]  # the new token lands in the last held block (no block to add)
    outs = []
    for use_kernel in (True, False):
        pool, full, _ = _filled_pool(name, hkv, d, bs, [n - 1 for n in lens], seed=4)
        tables = [[NULL_BLOCK if i < max(0, n - window) // bs else b for i, b in enumerate(t)]
                  for t, n in zip(full, lens)]
        model = torch.bfloat16 if name == "int4" else torch.float32  # as _filled_pool
        backend = TorchAttentionBackend(pool, 0.2, model)
        backend.windows = [window]  # the layer slides (the pool's spec is full attention)
        assert backend.paged_kernel is not None and backend.through_codec  # bf16: a cast
        if not use_kernel:
            backend.paged_kernel = None
        g = torch.Generator().manual_seed(9)
        q = torch.randn(len(lens), 8, d, generator=g).to(model)
        new_k, new_v = (torch.randn(len(lens), hkv, d, generator=g).to(model) for _ in "kv")
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        meta = AttentionMetadata(torch.tensor(slots), [],
                                 [SequenceSlice(i, 1, n, t) for i, (t, n) in
                                  enumerate(zip(tables, lens))], 0)
        state = backend.prepare(meta)
        assert (state.by_window[window].paged is not None) == use_kernel
        outs.append(backend.forward(0, q, new_k, new_v, meta, state))
        if use_kernel:  # plain softmax attention over the layer as stored, by the definitions
            kd, vd = _dequantized(pool, name)
            refs = [reference_paged_attention(q[i: i + 1], kd, vd, t, n, 0.2, window)[0]
                    for i, (t, n) in enumerate(zip(full, lens))]
    tol = 1e-2 if name == "int4" else 2e-5  # int4: outputs rounded to bf16
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=1e-5)
    for out, ref in zip(outs[0], refs):
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("cache,model", [(torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.float32)],
                         ids=["fp32-cache-bf16-model", "bf16-cache-fp32-model"])
def test_kernel_reads_a_float_cache_of_another_dtype_than_the_model(cache, model):
    """The backend is told the model's dtype: K/V are cast into the cache by the codec and the
    kernel reads the cache in its own dtype; the output equals the reference over the cache's
    values, in the model's dtype. A backend told nothing refuses K/V of another dtype."""
    hkv, d, bs = 2, 16, 4
    lens = [6, 13]
    q, k, v, tables = _case(cache, 8, hkv, d, bs, lens, seed=2)
    new_k, new_v = torch.randn(2, hkv, d).to(model), torch.randn(2, hkv, d).to(model)
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    meta = AttentionMetadata(torch.tensor(slots), [], [SequenceSlice(i, 1, n, tables[i])
                                                       for i, n in enumerate(lens)], 0)
    storage = KVStorage({torch.float32: "fp32", torch.bfloat16: "bf16"}[cache])
    pool = KVTensorPool.wrap(decoder_kv_spec(1, hkv, d, storage, bs), [(k, v)])
    backend = TorchAttentionBackend(pool, 0.25, model)
    assert backend.through_codec and backend.paged_kernel is not None
    out = backend.bind(meta)(0, q.to(model), new_k, new_v)
    assert out.dtype == model
    assert torch.equal(k.view(-1, hkv, d)[slots], new_k.to(cache))
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1].to(model), k, v, tables[i], n, 0.25)[0]
        torch.testing.assert_close(out[i].float(), ref, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="built for"):
        TorchAttentionBackend(pool, 0.25).bind(meta)(0, q.to(model), new_k, new_v)


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "sse2"])
def test_kernel_built_for_an_older_x86_matches_reference(march):
    """The kernel's vector width follows the instruction set it is built for (16 lanes with
    AVX-512, 8 with AVX2, 4 below): the machine running the tests builds it with
    -march=native, so the narrower paths are built here and checked the same way (and must
    run on this CPU, which has everything they use)."""
    flags = tuple(f"-march={march}" if f.startswith("-march") else f for f in CXXFLAGS)
    lib = load_library(cpu_paged.SOURCE, flags)
    assert lib is not None, f"the kernel did not build with -march={march}"
    narrow = cpu_paged.PagedDecodeKernel(lib)
    for h, hkv, d, bs in [(8, 2, 64, 16), (6, 2, 40, 48), (10, 2, 24, 20), (8, 2, 128, 16)]:
        _check_against_reference(narrow, torch.float32, h, hkv, d, bs)
