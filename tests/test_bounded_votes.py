"""H2O's and SnapKV's vote bookkeeping (kv/bounded.py `add_votes`, engine/bounded_kv.py
`compact_bounded`) against a plain reference written on true token positions.

The engine keeps a request's votes as one [layers, kv_heads, slots] tensor, adds each step's
votes into it in place, and gathers the kept slots at a compaction. The reference keeps, per layer
and KV head, a dict from true position to accumulated weight and applies H2O's rule (the heaviest
budget // 2 older tokens, then the most recent budget - budget // 2) in plain Python; the kept
positions and their weights must agree. The end-to-end parity with transformers is in
tests/test_bounded_kv.py; this one runs in milliseconds and pins the bookkeeping alone.
"""

from __future__ import annotations

import torch

from kvserve.engine.bounded_kv import BoundedCaches, compact_bounded
from kvserve.kv.bounded import BoundedKV, add_votes
from kvserve.request import Request
from kvserve.sampling import SamplingParams

LAYERS, HKV, BLOCK = 3, 2, 4


class _Reseats:
    """The manager's side of a compaction, as `compact_bounded` sees it (the block moves are
    tested with the real manager in tests/test_bounded_kv.py)."""

    block_size = BLOCK

    def blocks_for_tokens(self, n: int) -> int:
        return -(-n // BLOCK)

    def reseat(self, request: Request, num_blocks: int) -> tuple[list[int], list[int]]:
        return [0], [1]


def test_add_votes_pads_the_shorter_and_adds():
    gen = torch.Generator().manual_seed(0)
    total = torch.rand(LAYERS, HKV, 5, generator=gen)
    step = [torch.rand(HKV, 7, generator=gen) for _ in range(LAYERS)]
    want = torch.nn.functional.pad(total, (0, 2)) + torch.stack(step)
    assert torch.equal(add_votes(total.clone(), step), want)
    # a total longer than the step's votes (an earlier prefill chunk never is, but the rule holds)
    longer = torch.rand(LAYERS, HKV, 9, generator=gen)
    want = longer + torch.nn.functional.pad(torch.stack(step), (0, 2))
    assert torch.equal(add_votes(longer.clone(), step), want)
    assert torch.equal(add_votes(None, step), torch.stack(step))


def test_h2o_keeps_what_a_plain_reference_keeps():
    budget, prompt_len, chunk, steps = 10, 13, 5, 40
    bound = BoundedKV("h2o", budget, sink_tokens=0)
    request = Request("r", list(range(prompt_len)), SamplingParams(), max_tokens=steps,
                      bounded_kv=bound)
    gen = torch.Generator().manual_seed(1)
    heavy, recent = budget // 2, budget - budget // 2
    # the reference: per layer and head, the kept true positions (in slot order) and weights
    kept = [[[] for _ in range(HKV)] for _ in range(LAYERS)]
    acc = [[{} for _ in range(HKV)] for _ in range(LAYERS)]
    compactions = 0
    position = 0
    while position < prompt_len + steps:
        n = min(chunk, prompt_len - position) if position < prompt_len else 1
        for layer in range(LAYERS):
            for h in range(HKV):
                for t in range(position, position + n):
                    kept[layer][h].append(t)
                    acc[layer][h][t] = 0.0
        position += n
        request.num_computed_tokens = position
        slots = position - request.num_dropped_tokens
        votes = [torch.rand(HKV, slots, generator=gen) for _ in range(LAYERS)]
        for layer in range(LAYERS):
            for h in range(HKV):
                for slot, t in enumerate(kept[layer][h]):
                    acc[layer][h][t] += votes[layer][h, slot].item()
        moves = compact_bounded([request], _Reseats(), {"r": votes})
        if slots < budget + BLOCK or position < prompt_len:
            assert moves == []
            continue
        compactions += 1
        [move] = moves
        for layer in range(LAYERS):
            for h in range(HKV):
                row = kept[layer][h]
                old = row[:len(row) - recent]
                top = sorted(old, key=lambda t: -acc[layer][h][t])[:heavy]
                kept[layer][h] = sorted(top) + row[len(row) - recent:]
                got = [row[s] for s in move.keep[layer, h].tolist()]
                assert got == kept[layer][h], (layer, h)
                weights = [acc[layer][h][t] for t in kept[layer][h]]
                assert torch.allclose(request.kv_votes[layer, h],
                                      torch.tensor(weights), rtol=1e-5, atol=1e-6)
    assert compactions >= 3, "too few compactions to test the weights that move with tokens"


def test_backend_observation_matches_per_head_reference():
    """The torch backend's SnapKV/H2O votes (`_observe`, query heads grouped per KV head)
    against one softmax per query head, written out with the GQA rule (query head j reads KV
    head j // group); block table out of order, a chunk's observation rows in its middle."""
    from helpers import pool_over

    from kvserve.attention.base import SequenceSlice
    from kvserve.attention.torch_backend import TorchAttentionBackend

    heads, hkv, d, bs, blocks = 8, 2, 16, 4, 6
    gen = torch.Generator().manual_seed(2)
    caches = [(torch.randn(blocks, bs, hkv, d, generator=gen),
               torch.randn(blocks, bs, hkv, d, generator=gen))]
    scale = d ** -0.5
    backend = TorchAttentionBackend(pool_over(caches), scale)
    table = [4, 1, 5, 0, 2]
    seq_len, query_len, observe_start, observe_len = 19, 9, 3, 5
    seq = SequenceSlice(0, query_len, seq_len, table, observe_start, observe_len, key="r")
    q = torch.randn(query_len, heads, d, generator=gen)
    backend._observe(0, q, *caches[0], seq)
    [got] = backend.observed["r"]

    keys = torch.cat([caches[0][0][b] for b in table])[:seq_len]  # [seq_len, hkv, d]
    want = torch.zeros(hkv, seq_len)
    first = seq_len - query_len + observe_start
    for j in range(heads):
        for i in range(observe_len):
            visible = first + i + 1
            s = keys[:visible, j // (heads // hkv)] @ q[observe_start + i, j] * scale
            want[j // (heads // hkv), :visible] += s.softmax(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hooks_skip_a_step_without_bounded_requests():
    """`BoundedCaches.compact` walks the batch only when the step scheduled a bounded request
    (`observe_rows` saw one): a batch of plain requests costs nothing after the forward."""
    hooks = BoundedCaches(_Reseats())
    plain = Request("p", list(range(40)), SamplingParams(), max_tokens=4)
    plain.num_computed_tokens = 40
    assert hooks.observe_rows(plain, 0, 40) is None
    assert hooks.compact([plain], {}) == []
    bound = BoundedKV("streaming_llm", 8, sink_tokens=2)
    bounded = Request("b", list(range(20)), SamplingParams(), max_tokens=4, bounded_kv=bound)
    assert hooks.observe_rows(bounded, 0, 20) is None  # StreamingLLM observes nothing
    bounded.num_computed_tokens = 20
    [move] = hooks.compact([plain, bounded], {})
    assert move.keep.tolist() == [0, 1, 14, 15, 16, 17, 18, 19]
    assert bounded.num_dropped_tokens == 12
    assert hooks.compact([plain, bounded], {}) == [], "the next step scheduled none"
    hooks.reset(bounded)
    assert bounded.num_dropped_tokens == 0 and bounded.kv_votes is None
