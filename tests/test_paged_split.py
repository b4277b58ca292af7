"""Split-K in the CPU paged decode kernel (csrc/paged_decode.cpp, issue 49): a sequence's keys
in parts of 512 tokens (whole 256-token tiles, counted from its first visible block), each part
a work item of its own, merged by log-sum-exp. Long contexts with few KV heads (the batch-1
case the split is for), every storage format, windows that start inside a part, against the
plain-PyTorch reference (tests/reference_attention.py, the tolerances of test_cpu_paged.py);
and a verification's rows bit-identical to the same rows decoded alone where the group's
longest row has a part that the shorter ones do not see.
"""

from __future__ import annotations

import pytest
import torch
from reference_attention import reference_paged_attention
from test_cpu_paged import FORMATS, _case, _filled_pool, check_format_against_reference

from kvserve.attention import cpu_paged

kernel = cpu_paged.load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="paged decode kernel could not be built")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """One thread runs the parts one after another, two share them out: the same bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bs", [16, 40])
@pytest.mark.parametrize("window", [None, 700])
def test_split_matches_the_reference_in_every_format(name, bs, window, threads):
    """Lengths on both sides of a part's end (512 tokens with blocks of 16; with blocks of 40 a
    tile is 6 blocks and a part 12: 480 tokens) and several parts long, 3 KV heads of 3 query
    heads each (SmolLM2's grouping); a window of 700 starts inside a block and a part."""
    check_format_against_reference(name, 9, 3, 64, bs, [512, 513, 481, 1500, 2100], window,
                                   seed=bs + 1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("context,start", [(508, 0), (1533, 0), (2000, 0), (1533, 300)],
                         ids=["cross-512", "cross-1536", "4-parts", "start-300"])
def test_verification_rows_keep_their_bits_across_a_part_boundary(dtype, context, start,
                                                                  threads):
    """Five verification rows (one table, consecutive positions, new K/V stored by the call)
    whose longest row reaches into a part the shorter rows do not see (508 + 5 crosses 512,
    1533 + 5 crosses 1536): each row equals the reference, and equals bit for bit the same row
    decoded alone, where its keys make one part fewer. A common start (a window already past
    its first 300 tokens) moves the parts with it."""
    h, hkv, d, bs, rows = 9, 3, 64, 16, 5
    q, k, v, tables = _case(dtype, h, hkv, d, bs, [context + rows], seed=9)
    q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(10))
    new_k, new_v = torch.randn(rows, hkv, d).to(dtype), torch.randn(rows, hkv, d).to(dtype)
    lens = [context + j + 1 for j in range(rows)]
    table_t = torch.tensor(tables * rows)
    starts = torch.full((rows,), start) if start else None
    kv = cpu_paged.PagedKV(cpu_paged.FLOAT_KINDS[dtype], k, v, d)
    out = kernel.step(table_t, torch.tensor(lens), starts).run(q, kv, 0.125, new_k=new_k,
                                                               new_v=new_v)
    for j, n in enumerate(lens):
        window = n - start if start else None
        ref = reference_paged_attention(q[j: j + 1], k, v, tables[0], n, 0.125, window)[0]
        torch.testing.assert_close(out[j], ref, atol=2e-5, rtol=1e-5)
        alone = kernel.step(table_t[:1], torch.tensor([n]),
                            None if starts is None else starts[:1]).run(q[j: j + 1], kv, 0.125)
        assert torch.equal(out[j], alone[0]), f"row {j} differs from its decode alone"


@needs_kernel
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_quantized_rows_of_one_sequence_keep_their_bits(name, threads):
    """The quantized formats (no new K/V through the kernel): five rows at consecutive lengths
    of one table, the longest crossing 1,024 tokens (its third part), each row's bits those of
    its decode alone (int4 runs them one at a time, int8 and fp8 as one group)."""
    h, hkv, d, bs, rows = 9, 3, 64, 16, 5
    pool, tables, _ = _filled_pool(name, hkv, d, bs, [1026], seed=4,
                                   group_size=16 if name in ("int8", "int4") else None)
    lens = [1021 + j for j in range(rows)]
    table_t = torch.tensor(tables * rows)
    res_rows = None
    if name == "int4":
        res_rows = torch.tensor([[pool.codecs[0].residual.rows.get(b, -1) for b in t]
                                 for t in table_t.tolist()])
    kv = cpu_paged.paged_kv(pool.codecs[0], pool.layers[0], 0)
    q = torch.randn(rows, h, d, generator=torch.Generator().manual_seed(5))
    out = kernel.step(table_t, torch.tensor(lens), None, res_rows).run(q, kv, 0.125)
    for j, n in enumerate(lens):
        alone = kernel.step(table_t[:1], torch.tensor([n]), None,
                            None if res_rows is None else res_rows[:1]).run(q[j: j + 1], kv,
                                                                            0.125)
        assert torch.equal(out[j], alone[0]), f"row {j} differs from its decode alone"
