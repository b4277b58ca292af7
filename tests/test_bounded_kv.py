"""Bounded KV caches (issue 15, part 3) against an independent reference.

The reference is transformers' own forward on the same weights with a 4D attention mask whose
row t lets token t see exactly the true positions the policy keeps when t is computed (the
policy's rule written on true positions, in plain Python: the prompt is prefilled with full
attention; after the prompt, whenever the kept tokens reach budget + block_size they are cut
back to the sinks and the most recent budget - sinks). One forward over prompt + generated
tokens with that mask computes every token's K/V exactly as the engine's compacted cache saw
it, so the engine's greedy tokens and float32 logits must match it. A control shows that the
bound changes the output (the test can fail).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import generate_checked, kv_bytes_per_token, save_random_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.kv.bounded import BoundedKVConfig

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 512
NEW = 40
BUDGET, SINKS = 24, 4
WINDOW = 8  # SnapKV's observation window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, rope_theta=1e4)
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("bounded") / "qwen2", seed=3)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager")


def streaming_rows(prompt_len: int, total: int, budget: int, sinks: int, block_size: int
                   ) -> list[list[int]]:
    """For each token 0..total-1, the true positions it attends to under StreamingLLM."""
    rows = [list(range(t + 1)) for t in range(prompt_len)]
    kept = list(range(prompt_len))

    def cut() -> None:
        nonlocal kept
        if len(kept) >= budget + block_size:
            kept = kept[:sinks] + kept[len(kept) - (budget - sinks):]

    cut()
    for t in range(prompt_len, total):
        rows.append(kept + [t])
        kept.append(t)
        cut()
    return rows


def masked_logits(model, seq: list[int], rows: list[list[int]]) -> torch.Tensor:
    n = len(seq)
    mask = torch.full((1, 1, n, n), torch.finfo(torch.float32).min)
    for t, visible in enumerate(rows):
        mask[0, 0, t, visible] = 0.0
    with torch.no_grad():
        return model(torch.tensor([seq]), attention_mask=mask).logits[0]


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=256, **kwargs)


def _run_with_logits(llm: LLM, prompts, params, bounded=None):
    engine, runner = llm.engine, llm.engine.runner
    captured: dict[str, list[torch.Tensor]] = {}
    original = runner.forward

    def spy(seqs):
        out = original(seqs)
        for j, i in enumerate(out.sampled):
            captured.setdefault(seqs[i].request_id, []).append(out.logits[j].clone())
        return out

    runner.forward = spy
    ids = [engine.add_request({"prompt_token_ids": p}, params, bounded_kv=bounded)
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    runner.forward = original
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return [(p, done[i].outputs[0].token_ids, torch.stack(captured[i]))
            for p, i in zip(prompts, ids)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPT_LENGTHS = [5, 23, 40, 70]


@pytest.mark.parametrize("block_size,batched", [(8, None), (5, 16)])
def test_streaming_llm_matches_masked_transformers(checkpoint, hf_model, block_size, batched):
    rng = random.Random(block_size)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    kwargs = dict(block_size=block_size, bounded_kv_policy="streaming_llm",
                  bounded_kv_budget=BUDGET, bounded_kv_sink_tokens=SINKS)
    if batched:
        kwargs["max_num_batched_tokens"] = batched  # chunked prefill of the longer prompts
    llm = _llm(checkpoint, **kwargs)
    differs = False
    for p, gen, got in _run_with_logits(llm, prompts, GREEDY):
        seq = p + gen
        rows = streaming_rows(len(p), len(seq) - 1, BUDGET, SINKS, block_size)
        want = masked_logits(hf_model, seq[:-1], rows)[len(p) - 1:]
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (len(p), err)
        assert gen == want.argmax(-1).tolist()
        full = masked_logits(hf_model, seq[:-1], [list(range(t + 1)) for t in range(len(seq) - 1)])
        differs |= (full[len(p) - 1:] - want).abs().max().item() > 1e-3
    assert differs, "the bound never changed the logits: this test could not fail"


def test_per_request_bound_and_unbounded_neighbour(checkpoint, hf_model):
    """A bounded request beside an unbounded one in the same batches: each matches its own
    reference (the neighbour the full causal one)."""
    rng = random.Random(11)
    p = [rng.randrange(3, VOCAB) for _ in range(30)]
    llm = _llm(checkpoint, block_size=8)
    bounded = BoundedKVConfig("streaming_llm", BUDGET, SINKS)
    engine = llm.engine
    full_id = engine.add_request({"prompt_token_ids": p}, GREEDY)
    bounded_id = engine.add_request({"prompt_token_ids": p}, GREEDY, bounded_kv=bounded)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        engine.check_invariants()
    assert engine.kv.num_available_blocks == engine.kv.num_blocks
    full, bnd = done[full_id].outputs[0].token_ids, done[bounded_id].outputs[0].token_ids
    n = len(p) + NEW - 1
    want_full = masked_logits(hf_model, (p + full)[:-1], [list(range(t + 1)) for t in range(n)])
    want_bnd = masked_logits(hf_model, (p + bnd)[:-1], streaming_rows(len(p), n, BUDGET, SINKS, 8))
    assert full == want_full[len(p) - 1:].argmax(-1).tolist()
    assert bnd == want_bnd[len(p) - 1:].argmax(-1).tolist()
    assert full != bnd


def test_blocks_held_stay_bounded(checkpoint):
    """After the prompt, a bounded request never holds more than ceil((budget + block) / block)
    blocks, and it ends with no block leaked."""
    llm = _llm(checkpoint, block_size=8, bounded_kv_policy="streaming_llm",
               bounded_kv_budget=BUDGET)
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": list(range(3, 60))},
                             SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        table = engine.kv.block_tables.get(rid)
        if table is not None:
            most = max(most, len(table))
    assert most <= -(-(BUDGET + 8) // 8) + 0  # 4 blocks of 8 for 24 + 8 tokens
    assert engine.kv.num_available_blocks == engine.kv.num_blocks


def test_prefix_cache_never_holds_pruned_blocks(checkpoint):
    """A bounded request publishes its prompt's exact blocks, never compacted ones: a later
    full-cache request over its prompt + output hits only the prompt and matches the full
    model's own greedy output."""
    rng = random.Random(4)
    p = [rng.randrange(3, VOCAB) for _ in range(48)]
    llm = _llm(checkpoint, block_size=8)
    bounded = BoundedKVConfig("streaming_llm", BUDGET, SINKS)
    generate_checked(llm, [{"prompt_token_ids": p}],
                     SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": p},
                             SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             bounded_kv=bounded)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        engine.check_invariants()
    assert out.request_id == rid and out.num_cached_tokens == 47  # it reads the prefix cache
    follow = p + out.outputs[0].token_ids
    [again] = generate_checked(llm, [{"prompt_token_ids": follow}],
                               SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    # Only the prompt's 6 blocks are shared: the bounded request's output blocks were never
    # inserted (they hold compacted KV), so the follow-up computes them and matches a fresh
    # engine without prefix caching.
    # (a partial hit into block 6 can come from the full request's block: the first output
    # token of both was computed with full attention)
    assert 48 <= again.num_cached_tokens < 56
    fresh = _llm(checkpoint, block_size=8, enable_prefix_caching=False)
    [want] = generate_checked(fresh, [{"prompt_token_ids": follow}],
                              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("policy", ["streaming_llm", "snapkv", "h2o"])
def test_preemption_recomputes_and_bounds_again(checkpoint, policy):
    """A tiny pool preempts bounded requests: they recompute prompt + output with full
    attention and are bounded again (documented), deterministically, with no leaked block."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (30, 35, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _llm(checkpoint, block_size=8, bounded_kv_policy=policy,
                   bounded_kv_budget=BUDGET, bounded_kv_observation_window=WINDOW,
                   kv_cache_memory_bytes=14 * 8 * kv_bytes_per_token(checkpoint))
        engine = llm.engine
        limit = -(-(BUDGET + 8) // 8)  # blocks of a bounded request (test_blocks_held_...)
        rebounded = []  # preempted requests seen holding a bounded table past the budget
        step = engine.step

        def watched_step():
            out = step()
            for r in engine.scheduler.running:
                table = engine.kv.block_tables.get(r.request_id, ())
                if r.num_preemptions and r.num_tokens > BUDGET + 16 and len(table) <= limit:
                    rebounded.append(r.request_id)
            return out

        engine.step = watched_step
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)
        assert engine.scheduler.num_preemptions > 0, "the tiny pool forced no preemption"
        assert rebounded, "no preempted request was bounded again after its recompute"
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    assert all(len(t) == 60 for t in runs[0])


@pytest.mark.parametrize("kwargs,message", [
    (dict(bounded_kv_policy="lru", bounded_kv_budget=64), "must be one of"),
    (dict(bounded_kv_policy="streaming_llm", bounded_kv_budget=4, bounded_kv_sink_tokens=4),
     "larger than its 4 sink tokens"),
    (dict(bounded_kv_policy="streaming_llm", bounded_kv_budget=1000), "larger than the context"),
    (dict(bounded_kv_policy="streaming_llm", bounded_kv_budget=1.5), "whole number"),
    (dict(bounded_kv_policy="streaming_llm", bounded_kv_budget=-0.5), "whole number"),
    (dict(bounded_kv_policy="streaming_llm"), "go together"),
])
def test_bad_settings_refused(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _llm(checkpoint, **kwargs)


def test_fraction_budget_and_bad_request_setting(checkpoint):
    llm = _llm(checkpoint, bounded_kv_policy="streaming_llm", bounded_kv_budget=0.25)
    assert llm.engine.bounded_kv.budget == 64  # a quarter of max_model_len=256
    with pytest.raises(ValueError, match="must be one of"):
        llm.engine.add_request({"prompt_token_ids": [5, 6]}, GREEDY,
                               bounded_kv=BoundedKVConfig("h2o_typo", 32))
    assert not llm.engine.has_unfinished_requests()


def test_bounded_cache_refused_on_windowed_layers(tmp_path):
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=256,
        sliding_window=32, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    path = save_random_checkpoint(cfg, tmp_path / "mistral")
    with pytest.raises(ValueError, match="sliding-window layers"):
        _llm(path, bounded_kv_policy="streaming_llm", bounded_kv_budget=64)


# -- SnapKV -----------------------------------------------------------------------------------
# Its heads keep different tokens, so the reference needs a mask per layer and KV head: an
# attention function registered with transformers (its eager attention, with that mask) runs
# inside transformers' own Qwen2 model. It also records the softmaxed weights of the prompt
# forward, from which the test computes SnapKV's votes itself.
_REF: dict = {"masks": None, "weights": {}}


def _perhead_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                       **kwargs):
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    n = query.shape[2]
    masks = _REF["masks"]
    if masks is None:
        visible = torch.ones(n, n, dtype=torch.bool).tril()[None]
    else:
        visible = masks[module.layer_idx].repeat_interleave(groups, dim=0)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32)
    _REF["weights"][module.layer_idx] = weights[0]
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


@pytest.fixture(scope="module")
def perhead_model(checkpoint):
    transformers.AttentionInterface.register("kvserve_perhead_ref", _perhead_attention)
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="kvserve_perhead_ref")


def snapkv_reference_keep(model, prompt: list[int], budget: int, window: int
                          ) -> list[list[list[int]]]:
    """Per layer and KV head, the prompt positions SnapKV keeps (the rule in plain PyTorch on
    transformers' attention weights of the prompt)."""
    _REF["masks"], _REF["weights"] = None, {}
    with torch.no_grad():
        model(torch.tensor([prompt]))
    kept = []
    hkv = model.config.num_key_value_heads
    for layer in range(model.config.num_hidden_layers):
        w = _REF["weights"][layer]  # [H, P, P]
        votes = w[:, -window:, :].sum(1)  # [H, P]
        votes = votes.view(hkv, -1, len(prompt)).sum(1)
        pooled = torch.nn.functional.avg_pool1d(votes[:, None], 7, stride=1, padding=3,
                                                count_include_pad=False)[:, 0]
        prefix = len(prompt) - window
        top = pooled[:, :prefix].topk(budget - window, dim=-1).indices
        kept.append([sorted(top[h].tolist()) + list(range(prefix, len(prompt)))
                     for h in range(hkv)])
    return kept


def snapkv_masks(model, prompt: list[int], total: int, budget: int, sinks: int, window: int,
                 block_size: int) -> list[torch.Tensor]:
    p = len(prompt)
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    if p > budget:
        kept = snapkv_reference_keep(model, prompt, budget, window)
    else:
        kept = [[list(range(p)) for _ in range(hkv)] for _ in range(layers)]
    masks = [torch.zeros(hkv, total, total, dtype=torch.bool) for _ in range(layers)]
    for m in masks:
        m[:, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    for t in range(p, total):
        for layer in range(layers):
            for h in range(hkv):
                row = kept[layer][h] + [t]
                masks[layer][h, t, row] = True
                kept[layer][h] = row
                if len(row) >= budget + block_size:
                    kept[layer][h] = row[:sinks] + row[len(row) - (budget - sinks):]
    return masks


@pytest.mark.parametrize("block_size,batched", [(8, None), (5, 16)])
def test_snapkv_matches_per_head_reference(checkpoint, perhead_model, block_size, batched):
    rng = random.Random(20 + block_size)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (20, 30, 45, 70)]
    kwargs = {"block_size": block_size, "bounded_kv_policy": "snapkv",
              "bounded_kv_budget": BUDGET, "bounded_kv_sink_tokens": SINKS,
              "bounded_kv_observation_window": WINDOW}
    if batched:
        kwargs["max_num_batched_tokens"] = batched
    llm = _llm(checkpoint, **kwargs)
    differs = False
    for p, gen, got in _run_with_logits(llm, prompts, GREEDY):
        seq = p + gen
        masks = snapkv_masks(perhead_model, p, len(seq) - 1, BUDGET, SINKS, WINDOW, block_size)
        _REF["masks"] = masks
        with torch.no_grad():
            want = perhead_model(torch.tensor([seq[:-1]])).logits[0][len(p) - 1:]
        _REF["masks"] = None
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (len(p), err)
        assert gen == want.argmax(-1).tolist()
        heads_differ = any(not torch.equal(m[0], m[1]) for m in masks)
        differs |= heads_differ and len(p) > BUDGET
    assert differs, "no prompt made the heads keep different tokens: this test could not fail"


def test_snapkv_refused_without_torch_backend_weights(checkpoint):
    with pytest.raises(ValueError, match="larger than SnapKV's observation window"):
        _llm(checkpoint, bounded_kv_policy="snapkv", bounded_kv_budget=16,
             bounded_kv_observation_window=16)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_attention_policies_refused_on_a_backend_that_does_not_observe(checkpoint, policy):
    """The engine asks the backend interface (`AttentionBackend.observes_attention`): the torch
    backend computes observation weights, the Triton and MLA ones do not."""
    from kvserve.attention.mla import TorchMLABackend
    from kvserve.attention.torch_backend import TorchAttentionBackend

    assert TorchAttentionBackend.observes_attention
    assert not TorchMLABackend.observes_attention
    try:
        from kvserve.attention.triton_backend import TritonAttentionBackend
    except ImportError:  # no triton here: nothing to say about its backend
        pass
    else:
        assert not TritonAttentionBackend.observes_attention
    llm = _llm(checkpoint)
    llm.engine.backend.observes_attention = False  # as a backend without weights says
    with pytest.raises(ValueError, match="only the torch attention backend computes"):
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY,
                               bounded_kv=BoundedKVConfig(policy, BUDGET, SINKS, WINDOW))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY,  # StreamingLLM needs none
                           bounded_kv=BoundedKVConfig("streaming_llm", BUDGET, SINKS))
    assert llm.engine.has_unfinished_requests()


# -- H2O --------------------------------------------------------------------------------------
def h2o_reference(model, prompt: list[int], seq: list[int], budget: int, block_size: int
                  ) -> torch.Tensor:
    """Logits of transformers' model over `seq` when every layer and KV head keeps what H2O
    keeps, computed token by token: each forward's attention weights (of the reference's own
    softmax) accumulate per key, and the mask of the next token follows from them."""
    p, total = len(prompt), len(seq)
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    heavy, recent = budget // 2, budget - budget // 2
    masks = [torch.zeros(hkv, total, total, dtype=torch.bool) for _ in range(layers)]
    for m in masks:
        m[:, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    kept = [[list(range(p)) for _ in range(hkv)] for _ in range(layers)]
    acc = [[dict.fromkeys(range(p), 0.0) for _ in range(hkv)] for _ in range(layers)]

    def forward(n: int) -> torch.Tensor:
        _REF["masks"] = [m[:, :n, :n] for m in masks]
        with torch.no_grad():
            logits = model(torch.tensor([seq[:n]])).logits[0]
        _REF["masks"] = None
        return logits

    def accumulate(rows: range) -> None:
        for layer in range(layers):
            w = _REF["weights"][layer]  # [H, n, n]
            votes = w[:, rows, :].sum(1).view(hkv, -1, w.shape[-1]).sum(1)
            for h in range(hkv):
                for key in kept[layer][h]:
                    acc[layer][h][key] += votes[h, key].item()

    def cut() -> None:
        for layer in range(layers):
            for h in range(hkv):
                row = kept[layer][h]
                if len(row) < budget + block_size:
                    continue
                old = row[:len(row) - recent]
                scores = torch.tensor([acc[layer][h][k] for k in old])
                top = sorted(old[i] for i in scores.topk(heavy).indices.tolist())
                kept[layer][h] = top + row[len(row) - recent:]

    logits = forward(p)
    accumulate(range(p))
    cut()
    for t in range(p, total):
        for layer in range(layers):
            for h in range(hkv):
                kept[layer][h] = kept[layer][h] + [t]
                acc[layer][h][t] = 0.0
                masks[layer][h, t, kept[layer][h]] = True
        logits = forward(t + 1)
        accumulate(range(t, t + 1))
        cut()
    return logits


# One scenario (odd blocks, chunked prefill): the token-by-token reference is the slow part.
@pytest.mark.parametrize("block_size,batched", [(5, 16)])
def test_h2o_matches_per_head_reference(checkpoint, perhead_model, block_size, batched):
    rng = random.Random(40 + block_size)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (12, 45)]
    kwargs = {"block_size": block_size, "bounded_kv_policy": "h2o",
              "bounded_kv_budget": BUDGET}
    if batched:
        kwargs["max_num_batched_tokens"] = batched
    llm = _llm(checkpoint, **kwargs)
    for p, gen, got in _run_with_logits(llm, prompts, GREEDY):
        seq = p + gen
        want = h2o_reference(perhead_model, p, seq[:-1], BUDGET, block_size)[len(p) - 1:]
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (len(p), err)
        assert gen == want.argmax(-1).tolist()
        full = masked_logits(perhead_model, seq[:-1],
                             [list(range(t + 1)) for t in range(len(seq) - 1)])[len(p) - 1:]
        assert (full - want).abs().max().item() > 1e-3, "H2O changed nothing: cannot fail"


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_attention_policies_do_not_read_the_prefix_cache(checkpoint, policy):
    """SnapKV and H2O select by the attention of prompt queries, which a cached block does not
    hold: with the prompt cached they compute it anyway, and their output equals a cold
    engine's."""
    rng = random.Random(6)
    p = [rng.randrange(3, VOCAB) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"block_size": 8, "bounded_kv_policy": policy, "bounded_kv_budget": BUDGET,
              "bounded_kv_observation_window": WINDOW}
    llm = _llm(checkpoint, **kwargs)
    generate_checked(llm, [{"prompt_token_ids": p}], params)
    [warm] = generate_checked(llm, [{"prompt_token_ids": p}], params)
    assert warm.num_cached_tokens == 0
    [cold] = generate_checked(_llm(checkpoint, enable_prefix_caching=False, **kwargs),
                              [{"prompt_token_ids": p}], params)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_bounded_cache_refused_on_a_quantized_kv_cache(checkpoint):
    with pytest.raises(ValueError, match="model's own dtype"):
        _llm(checkpoint, kv_cache_dtype="int8", bounded_kv_policy="streaming_llm",
             bounded_kv_budget=64)
