"""Each Triton kernel against a PyTorch reference on small shapes.

Without a GPU the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set here before triton is first imported); with one they run on it. Shapes cover GQA, MQA and
MHA, several block sizes, a head_dim that is not a power of two, ragged lengths, scattered block
tables, cached prefixes, and float32/bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvserve.attention import triton_kernels as tk  # noqa: E402
from kvserve.attention import triton_tiles  # noqa: E402
from kvserve.attention.base import AttentionMetadata, SequenceSlice  # noqa: E402
from kvserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from helpers import pool_over  # noqa: E402
from reference_attention import reference_paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, hkv, d)
    return (torch.randn(shape, generator=gen).to(DEVICE, dtype),
            torch.randn(shape, generator=gen).to(DEVICE, dtype))


def _tables(lens: list[int], block_size: int, num_blocks: int,
            gen: torch.Generator) -> list[list[int]]:
    """Disjoint, scattered block tables (a random permutation of the pool)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    out, at = [], 0
    for n in lens:
        k = -(-n // block_size)
        out.append(perm[at: at + k])
        at += k
    return out


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=DEVICE)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# -- (a) store --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.zeros(6, 4, 2, 24, dtype=dtype, device=DEVICE) for _ in range(2))
    # k and v as strided views of one fused projection, as the model hands them over.
    qkv = torch.randn(5, 8, 24, generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 17, 0, 23], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    ref_k = torch.zeros_like(k_cache).view(-1, 2, 24)
    ref_v = torch.zeros_like(v_cache).view(-1, 2, 24)
    keep = slots >= 0
    ref_k[slots[keep]] = k[keep]
    ref_v[slots[keep]] = v[keep]
    assert torch.equal(k_cache.view(-1, 2, 24), ref_k)
    assert torch.equal(v_cache.view(-1, 2, 24), ref_v)


# -- (b) decode -------------------------------------------------------------------------------
DECODE_SHAPES = {  # (query heads, kv heads, head_dim, block_size)
    "gqa": (4, 2, 32, 4),
    "mqa": (4, 1, 32, 16),
    "mha-d24-bs1": (2, 2, 24, 1),
    "gqa7-bs8": (7, 1, 16, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference(shape, dtype, num_splits):
    h, hkv, d, bs = DECODE_SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    lens = [1, 5, 2 * bs + 1, 37]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = _cache(num_blocks, bs, hkv, d, dtype, gen)
    tables = _tables(lens, bs, num_blocks, gen)
    q = torch.randn(len(lens), h, d, generator=gen).to(DEVICE, dtype)
    scale = d ** -0.5
    out = tk.decode_attention(q, k_cache, v_cache, _padded(tables), _i32(lens), scale,
                              num_splits=num_splits, block_n=16)
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1], k_cache, v_cache, tables[i], n, scale)
        torch.testing.assert_close(out[i].float(), ref[0], atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_padding_row_gives_zeros_not_nan():
    """A CUDA-graph padding row may have no KV at all; the merge must not divide by zero."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _cache(2, 4, 1, 16, torch.float32, gen)
    q = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    out = tk.decode_attention(q, k_cache, v_cache, _padded([[0], [1]]), _i32([3, 0]), 0.25,
                              num_splits=2, block_n=16)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


# -- (c) extend -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d,bs", [(4, 2, 32, 4), (4, 1, 16, 16), (2, 2, 24, 1)])
def test_extend_attention_over_cached_prefix(h, hkv, d, bs, dtype):
    gen = torch.Generator().manual_seed(3)
    # (cached prefix, new tokens): a cold prefill, prefix + extend, a one-token chunk, a chunk
    # longer than one tile that starts mid-block.
    seqs = [(0, 9), (6, 5), (13, 1), (3, 21)]
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    k_cache, v_cache = _cache(num_blocks, bs, hkv, d, dtype, gen)
    tables = _tables(lens, bs, num_blocks, gen)
    q_lens = [n for _, n in seqs]
    starts = [sum(q_lens[:i]) for i in range(len(seqs))]
    total = sum(q_lens)
    q = torch.randn(total + 2, h, d, generator=gen).to(DEVICE, dtype)  # 2 rows nobody owns
    out = torch.full_like(q, 7.0)
    tk.extend_attention(q, k_cache, v_cache, _padded(tables), _i32(starts), _i32(q_lens),
                        _i32(lens), max(q_lens), d ** -0.5, out=out)
    for i, (start, n) in enumerate(zip(starts, q_lens)):
        ref = reference_paged_attention(q[start: start + n], k_cache, v_cache, tables[i],
                                        lens[i], d ** -0.5)
        torch.testing.assert_close(out[start: start + n].float(), ref, atol=TOL[dtype],
                                   rtol=TOL[dtype])
    assert (out[total:] == 7.0).all(), "rows outside every sequence were written"


# -- (d) copy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_every_layer(dtype):
    gen = torch.Generator().manual_seed(4)
    caches = [_cache(8, 4, 2, 16, dtype, gen) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    src, dst = [1, 5, 2], [6, 0, 7]
    tk.copy_blocks(caches, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    for (k, v), (k0, v0) in zip(caches, before):
        ref_k, ref_v = k0.clone(), v0.clone()
        ref_k[dst], ref_v[dst] = k0[src], v0[src]
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


# -- the backend against the PyTorch backend ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_backend_on_a_mixed_step(dtype):
    """Prefill chunks (cold and over a cached prefix) and decodes in one flat batch: the same
    outputs and the same cache contents as the CPU backend."""
    gen = torch.Generator().manual_seed(5)
    h, hkv, d, bs, nb = 4, 2, 32, 4, 24
    k_init, v_init = _cache(nb, bs, hkv, d, dtype, gen)
    # (context, new tokens); the last two are decodes.
    seqs = [(0, 7), (5, 4), (9, 1), (2, 1)]
    lens = [c + n for c, n in seqs]
    tables = _tables(lens, bs, nb, gen)
    slices, slots, start = [], [], 0
    for (c, n), table in zip(seqs, tables):
        slices.append(SequenceSlice(start, n, c + n, table))
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
        start += n
    meta = AttentionMetadata(torch.tensor(slots), prefills=slices[:2], decodes=slices[2:],
                             num_prefill_tokens=11)
    t = start
    q = torch.randn(t, h, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(DEVICE, dtype)
    ref_caches = [(k_init.cpu().clone(), v_init.cpu().clone())]
    ref = TorchAttentionBackend(pool_over(ref_caches), d ** -0.5)
    expected = ref.bind(meta)(0, q.cpu(), k.cpu(), v.cpu())
    caches = [(k_init.clone(), v_init.clone())]
    backend = TritonAttentionBackend(pool_over(caches), d ** -0.5)
    got = backend.bind(meta)(0, q, k, v)
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.equal(caches[0][0].cpu(), ref_caches[0][0])
    assert torch.equal(caches[0][1].cpu(), ref_caches[0][1])
    backend.copy_blocks([tables[0][0]], [tables[3][-1]])
    assert torch.equal(caches[0][0][tables[3][-1]], caches[0][0][tables[0][0]])


def test_pool_read_write_blocks_round_trip():
    """The storage tiers' interface works on the Triton backend's device tensors too."""
    gen = torch.Generator().manual_seed(6)
    caches = [_cache(6, 4, 2, 16, torch.float32, gen) for _ in range(2)]
    pool = pool_over(caches)
    TritonAttentionBackend(pool, 0.25)
    data = pool.read_blocks([1, 4])
    assert data.shape == (2, 2, 8, 2, 16) and data.device.type == "cpu"
    pool.write_blocks([0, 5], data)
    for k, v in caches:
        assert torch.equal(k[0], k[1]) and torch.equal(v[5], v[4])


# -- errors -----------------------------------------------------------------------------------
def test_unsupported_caches_raise_clear_errors():
    with pytest.raises(ValueError, match="head_dim"):
        TritonAttentionBackend(pool_over([(torch.zeros(2, 4, 1, 8, device=DEVICE),) * 2]), 1.0)
    with pytest.raises(ValueError, match="KV caches"):
        TritonAttentionBackend(pool_over(
            [(torch.zeros(2, 4, 1, 16, dtype=torch.int8, device=DEVICE),) * 2]), 1.0)
    with pytest.raises(ValueError, match="block_size"):
        pool_over([(torch.zeros(2, 4, 1, 16, device=DEVICE),) * 2], block_size=8)


def test_decode_split_choice():
    # batch 1 on a big GPU: many splits; a full batch or a short context: one.
    assert tk.decode_splits(1, 4, 4096, num_sms=132) == 32
    assert tk.decode_splits(3, 4, 4096, num_sms=132) == 16  # 22, rounded down to a power of 2
    assert tk.decode_splits(256, 8, 4096, num_sms=132) == 1
    assert tk.decode_splits(1, 4, 100, num_sms=132) == 1


def test_graph_batch_sizes():
    from kvserve.worker.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(4096)[-1] == 512


# -- fused element-wise kernels of the decoder (kvserve.kernels.gpu.ops) -------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_ops_match_torch(dtype):
    from kvserve.kernels.gpu import ops as gpu_ops
    from kvserve.layers.norm import rms_norm
    from kvserve.layers.rotary import apply_rope

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(48, generator=gen)).to(DEVICE, dtype)
    # 16-bit: one unit in the last place (rounding order); float32: summation order only.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(gpu_ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6),
                               **tol)
    # Per-head weights on a strided [T, heads, D] view (Qwen3's q/k norm).
    fused = torch.randn(5, 7, 32, generator=gen).to(DEVICE, dtype)
    qk = fused[:, :6]
    wh = (1 + 0.1 * torch.randn(6, 32, generator=gen)).to(DEVICE, dtype)
    torch.testing.assert_close(gpu_ops.rms_norm(qk, wh, 1e-6), rms_norm(qk, wh, 1e-6),
                               **tol)
    cos_sin = torch.randn(5, 32, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(gpu_ops.apply_rope(qk, cos_sin),
                               apply_rope(qk, cos_sin), **tol)
    gate_up = torch.randn(5, 2 * 40, generator=gen).to(DEVICE, dtype)
    ref = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(gpu_ops.silu_mul(gate_up), ref, **tol)


# -- quantized caches (kv/quant.py): dequantized as the kernels load them ----------------------
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2", "int8"])
def test_backend_reads_quantized_caches_like_the_torch_backend(kv_dtype, window):
    """A mixed step over a quantized pool: the Triton kernels' dequantize-on-load gives the
    torch backend's outputs (itself checked against a reference of each scheme in
    test_kv_quant.py, windows included) and leaves the same stored bytes and scales; with a
    sliding window of 5, shorter than the longest sequences (9 and 10 tokens)."""
    from kvserve.kv.spec import KVStorage, decoder_kv_spec
    from kvserve.kv.tensors import KVTensorPool

    gen = torch.Generator().manual_seed(7)
    h, hkv, d, bs, nb = 4, 2, 32, 4, 24
    spec = decoder_kv_spec(1, hkv, d, KVStorage(kv_dtype), bs, (window,))
    scales = torch.tensor([[0.02, 0.01]])  # per-tensor fp8 scales, as from a checkpoint
    seqs = [(0, 7), (5, 4), (9, 1), (2, 1)]
    tables = _tables([c + n for c, n in seqs], bs, nb, gen)
    # the cached prefixes: written by a first step through the same (torch) store path
    prefix = [(t, 0, c) for (c, _), t in zip(seqs, tables) if c]
    ctx_slots = torch.tensor([t[p // bs] * bs + p % bs for t, _, c in prefix for p in range(c)])
    ctx_k = torch.randn(len(ctx_slots), hkv, d, generator=gen) * 0.5
    ctx_v = torch.randn(len(ctx_slots), hkv, d, generator=gen) * 0.5
    slices, slots, start = [], [], 0
    for (c, n), table in zip(seqs, tables):
        slices.append(SequenceSlice(start, n, c + n, table))
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
        start += n
    meta = AttentionMetadata(torch.tensor(slots), prefills=slices[:2], decodes=slices[2:],
                             num_prefill_tokens=11)
    q = torch.randn(start, h, d, generator=gen)
    k = torch.randn(start, hkv, d, generator=gen) * 0.5
    v = torch.randn(start, hkv, d, generator=gen) * 0.5
    pools = []
    for _ in range(2):
        pool = KVTensorPool(spec, nb, kv_scales=scales if kv_dtype == "fp8" else None)
        pool.store(0, ctx_k, ctx_v, ctx_slots)
        pools.append(pool)
    expected = TorchAttentionBackend(pools[0], d ** -0.5).bind(meta)(0, q, k, v)
    if DEVICE != "cpu":
        pools[1].layers = [tuple(t.to(DEVICE) for t in ts) for ts in pools[1].layers]
    backend = TritonAttentionBackend(pools[1], d ** -0.5)
    got = backend.bind(meta)(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)
    for a, b in zip(pools[0].layers[0], pools[1].layers[0]):
        assert torch.equal(a, b.cpu())
    # the quantization is not a no-op: the same step over an unquantized cache differs
    plain = TorchAttentionBackend(pool_over([tuple(
        torch.zeros(nb, bs, hkv, d) for _ in range(2))], windows=(window,)), d ** -0.5)
    plain.pool.store(0, ctx_k, ctx_v, ctx_slots)
    assert (plain.bind(meta)(0, q, k, v) - expected).abs().max() > 1e-4


def test_fp8_bits_decode_every_byte():
    """The kernels' fp8 decoder, applied to all 256 bytes, equals PyTorch's float8 dtypes
    (NaN/inf codes excluded: the codec saturates and never stores them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(src, dst, FP8_EXP: tl.constexpr, FP8_MANT: tl.constexpr,
               FP8_BIAS: tl.constexpr):
        offs = tl.arange(0, 256)
        x = tl.load(src + offs)
        tl.store(dst + offs, triton_tiles.fp8_bits_to_f32(x, FP8_EXP, FP8_MANT, FP8_BIAS))

    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    for kind, dtype in ((tk.KV_FP8_E4M3, torch.float8_e4m3fn), (tk.KV_FP8_E5M2, torch.float8_e5m2)):
        out = torch.empty(256, device=DEVICE)
        exp, mant, bias = tk._FP8_BITS[kind]
        decode[(1,)](raw, out, FP8_EXP=exp, FP8_MANT=mant, FP8_BIAS=bias)
        want = raw.cpu().view(dtype).float()
        finite = want.isfinite()
        assert torch.equal(out.cpu()[finite], want[finite])


def test_int4_pools_stay_on_the_torch_backend():
    from kvserve.kv.spec import KVStorage, decoder_kv_spec
    from kvserve.kv.tensors import KVTensorPool

    pool = KVTensorPool(decoder_kv_spec(1, 2, 32, KVStorage("int4", key_group_tokens=4), 4), 4)
    with pytest.raises(ValueError, match="torch backend"):
        TritonAttentionBackend(pool, 0.1)
