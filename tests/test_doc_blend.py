"""Document reuse anywhere in the prompt (kvserve/blend/, worker/placement.py).

References: transformers' own greedy continuation on the same weights (with every reused token
recomputed, blending must compute exactly the prompt's KV); the KV a document request stored,
rotated to the new position by cos/sin rows of transformers' own RoPE table (a placement must
copy exactly that); the same engine with blending off (unmarked prompts, and requests beside
blended ones, must not change). Every step passes the scheduler/KV invariants
(tests/conftest.py) and every run ends with every block back in the pool.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generate_checked, hf_greedy, kv_bytes_per_token, random_prompts, \
    save_random_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.blend.config import load_blend_config
from kvserve.blend.parts import check_spans, tokenize_parts
from kvserve.blend.select import plan_blend
from kvserve.config import EngineConfig
from kvserve.engine import scheduler as scheduler_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# -- the plan ---------------------------------------------------------------------------------
def test_plan_computes_the_text_between_documents_and_each_documents_first_share():
    plan = plan_blend(10, 100, ((20, 40), (45, 70)), 0.15)
    assert plan.runs == ((10, 23), (40, 49), (70, 100))
    assert plan.placed == ((20, 40, 20), (45, 70, 45))
    assert (plan.reused, plan.recomputed, plan.computed) == (38, 7, 45)
    assert plan_blend(0, 50, (), 0.1) is None
    assert plan_blend(40, 50, ((0, 40),), 0.1) is None  # the prefix cache holds it all
    # a document the prefix hit covers in part is placed from where the hit ends
    assert plan_blend(30, 60, ((20, 40),), 0.0).placed == ((30, 40, 20),)
    # CacheBlend's selection: every position in the first layers, each document's share
    # chosen after them
    plan = plan_blend(10, 100, ((20, 40), (45, 70)), 0.15, "deviation")
    assert plan.runs == ((10, 100),) and plan.cost == 90
    assert plan.choose == ((20, 40, 3), (45, 70, 4))
    assert (plan.reused, plan.recomputed, plan.computed) == (38, 7, 45)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_plan_covers_every_position_once_and_never_a_single_row(data):
    end = data.draw(st.integers(2, 120))
    cuts = sorted(data.draw(st.sets(st.integers(0, end), max_size=8)))
    spans = tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a)
    start = data.draw(st.integers(0, end - 1))
    fraction = data.draw(st.sampled_from([0.0, 0.1, 0.15, 0.5, 1.0]))
    plan = plan_blend(start, end, spans, fraction)
    if plan is None:
        return
    computed = [p for a, b in plan.runs for p in range(a, b)]
    placed = {p for a, b, _ in plan.placed for p in range(a, b)}
    assert len(computed) == len(set(computed)) and computed == sorted(computed)
    assert set(computed) | placed == set(range(start, end))  # nothing left out
    assert set(range(start, end)) - placed <= set(computed)  # text outside documents computed
    assert end - 1 in computed  # the sampling position
    assert all(b - a >= 2 for a, b in plan.runs)
    assert plan.reused + plan.recomputed == len(placed)
    assert plan.recomputed + plan.computed == len(computed) == plan.cost


# -- inputs and config --------------------------------------------------------------------------
def test_parts_are_tokenized_alone_and_spans_checked(tiny_model_dir):
    from kvserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    parts = tokenize_parts(tok, ["Hello there. ", {"text": "A document.",
                                                   "cache_control": {"type": "document"}},
                                 {"type": "text", "text": " Question?"}])
    a, b = parts.documents[0]
    assert parts.token_ids[a:b] == tok.encode("A document.", add_special_tokens=False)
    assert parts.text == "Hello there. A document. Question?"
    with pytest.raises(ValueError, match="non-empty list"):
        tokenize_parts(tok, [])
    with pytest.raises(ValueError, match="cache_control must be"):
        tokenize_parts(tok, [{"text": "x", "cache_control": {"type": "forever"}}])
    with pytest.raises(ValueError, match="only text parts"):
        tokenize_parts(tok, [{"type": "image_url", "image_url": "x"}])
    assert check_spans([[1, 3], [3, 5]], 6) == ((1, 3), (3, 5))
    with pytest.raises(ValueError, match="must not overlap"):
        check_spans([[1, 4], [3, 5]], 6)
    with pytest.raises(ValueError, match="not a non-empty span"):
        check_spans([[4, 9]], 6)


def test_config_and_feature_table_refusals(tiny_model_dir):
    assert load_blend_config('{"recompute_fraction": 0.3}').recompute_fraction == 0.3
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['fraction'\]"):
        load_blend_config({"fraction": 0.3})
    with pytest.raises(ValueError, match="recompute_fraction must be a number in"):
        load_blend_config({"recompute_fraction": 1.5})
    with pytest.raises(ValueError, match="selection must be one of"):
        load_blend_config({"selection": "random"})
    with pytest.raises(ValueError, match="check_layer must be an integer >= 1"):
        load_blend_config({"check_layer": 0})
    with pytest.raises(ValueError, match="rotates stored keys in the model's float type"):
        LLM(model=str(tiny_model_dir), blend_config={}, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(blend_config={}, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(blend_config={}, tensor_parallel_size=2)


# -- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random Llama (llama3 RoPE scaling, 2 layers) whose greedy output depends on its
    whole context."""
    from conftest import _hf_config

    return save_random_checkpoint(_hf_config("llama"), tmp_path_factory.mktemp("blend") / "l")


def _rag(seed: int, num_docs: int = 3) -> list[dict]:
    """Prompts of a system text, documents from a shared pool in several orders, a question."""
    system, *docs = random_prompts([12] + [29 + 3 * i for i in range(5)], 512, seed=1)
    questions = random_prompts([7, 9, 6], 512, seed=seed)
    orders = [[0, 1, 2], [2, 0, 4], [3, 1, 0]]
    prompts = []
    for order, question in zip(orders, questions):
        ids, spans = list(system), []
        for i in order[:num_docs]:
            spans.append([len(ids), len(ids) + len(docs[i])])
            ids += docs[i]
        prompts.append({"prompt_token_ids": ids + question, "documents": spans})
    return prompts


def _plain(prompts: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]


def _blend_llm(path, fraction: float, **kw) -> LLM:
    return LLM(model=str(path), blend_config={"recompute_fraction": fraction}, block_size=8,
               seed=0, **kw)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from conftest import _hf_config

    return save_random_checkpoint(_hf_config("qwen2"), tmp_path_factory.mktemp("blend") / "q")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_recomputing_every_reused_token_equals_transformers(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts = _rag(seed=2)
    llm = _blend_llm(model_dir, 1.0)
    generate_checked(llm, prompts[:1], GREEDY)  # its documents stored, then reused below
    outs = generate_checked(llm, prompts, GREEDY)
    counters = llm.engine.scheduler.blend.counters
    assert counters.blended_requests >= 3 and counters.recomputed_tokens > 0
    want = hf_greedy(model_dir, [p["prompt_token_ids"] for p in prompts], GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("anchor", ["prefix", "separator"])
def test_placed_kv_is_the_stored_kv_rotated_to_its_position(llama_dir, monkeypatch, anchor):
    """With nothing recomputed, the request's KV at a document's positions is the document
    request's stored KV, keys turned by RoPE from their stored positions to their new ones
    (computed here from transformers' cos/sin, not kvserve's table)."""
    import transformers

    llm = None
    captured = _capture_kv(monkeypatch, lambda: llm.engine)
    llm = LLM(model=str(llama_dir), block_size=8, seed=0,
              blend_config={"recompute_fraction": 0.0, "anchor": anchor,
                            "selection": "first"})
    prompt = _rag(seed=3)[0]
    generate_checked(llm, [prompt], SamplingParams(max_tokens=1))
    sep = llm.engine.scheduler.blend.separator if anchor == "separator" \
        else prompt["prompt_token_ids"][:prompt["documents"][0][0]]
    doc_ids = sorted(k for k in captured if k.startswith("kvserve-doc-"))
    request_kv = captured[next(k for k in captured if not k.startswith("kvserve-doc-"))]
    cfg = transformers.AutoConfig.from_pretrained(llama_dir)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    positions = torch.arange(1024)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = cos[0], sin[0]
    for doc_id, (a, b) in zip(doc_ids, prompt["documents"]):
        stored = captured[doc_id]
        for layer, (k_req, v_req) in enumerate(request_kv):
            k_doc, v_doc = stored[layer][0], stored[layer][1]
            src = torch.arange(len(sep), len(sep) + b - a)
            want = _turned(k_doc[src], src, torch.arange(a, b), cos, sin)
            torch.testing.assert_close(k_req[a:b], want, atol=2e-5, rtol=1e-4)
            assert torch.equal(v_req[a:b], v_doc[src])


def _turned(k: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    """Keys [n, heads, dim] computed at positions `src`, rotated to positions `dst` by the
    angle difference of transformers' cos/sin rows (rotate-half convention)."""
    half = cos.shape[-1] // 2
    angle_cos = cos[dst] * cos[src] + sin[dst] * sin[src]
    angle_sin = sin[dst] * cos[src] - cos[dst] * sin[src]
    x1, x2 = k[..., :half], k[..., half:]
    c, s = angle_cos[:, None, :half], angle_sin[:, None, :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """The random Llama with 4 layers: rows can leave the forward after layer 1."""
    from conftest import _hf_config

    config = _hf_config("llama")
    config.num_hidden_layers = 4
    return save_random_checkpoint(config, tmp_path_factory.mktemp("blend") / "l4")


def _capture_kv(monkeypatch, engine_of) -> dict[str, list[torch.Tensor]]:
    """Each finishing request's KV (per layer, [2, positions, heads, dim]) by request id."""
    captured: dict[str, list[torch.Tensor]] = {}
    finish = scheduler_module.Scheduler.finish

    def capture(self, request, status):
        table = self.kv.block_table(request)
        bs = self.kv.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(request.num_tokens - 1)])
        captured[request.request_id] = [torch.stack([t.view(-1, *t.shape[2:])[slots]
                                                     for t in layer]).clone()
                                        for layer in engine_of().tensors.layers]
        return finish(self, request, status)

    monkeypatch.setattr(scheduler_module.Scheduler, "finish", capture)
    return captured


def test_deviation_selection_recomputes_the_rows_whose_kv_moved_most(llama4_dir, monkeypatch):
    """CacheBlend's selection against transformers: in layers 0-1 every row's KV is the exact
    KV of the whole prompt (transformers' cache); after layer 1 each document keeps exactly
    its rows whose exact layer-1 K/V lie farthest from the stored K/V turned to their
    positions (the reference computes that choice itself), and only those are recomputed:
    every other row keeps the stored KV in layers 2-3."""
    import transformers

    llm = None
    captured = _capture_kv(monkeypatch, lambda: llm.engine)
    llm = LLM(model=str(llama4_dir), block_size=8, seed=0,
              blend_config={"recompute_fraction": 0.25, "anchor": "separator",
                            "selection": "deviation", "check_layer": 1})
    prompt = _rag(seed=3)[0]
    generate_checked(llm, [prompt], SamplingParams(max_tokens=1))
    sep = len(llm.engine.scheduler.blend.separator)
    request_kv = captured[next(k for k in captured if not k.startswith("kvserve-doc-"))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama4_dir, dtype=torch.float32)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt["prompt_token_ids"]]), use_cache=True).past_key_values
    exact = [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
             for layer in cache.layers]
    for layer in (0, 1):
        torch.testing.assert_close(request_kv[layer][0], exact[layer][0], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(request_kv[layer][1], exact[layer][1], atol=1e-4, rtol=1e-3)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf.config)
    cos, sin = (t[0] for t in rope(torch.zeros(1), torch.arange(1024)[None]))
    doc_ids = sorted(k for k in captured if k.startswith("kvserve-doc-"))
    recomputed = 0
    for doc_id, (a, b) in zip(doc_ids, prompt["documents"]):
        src, dst = torch.arange(sep, sep + b - a), torch.arange(a, b)
        placed = [(_turned(captured[doc_id][layer][0][src], src, dst, cos, sin),
                   captured[doc_id][layer][1][src]) for layer in range(4)]
        k1, v1 = exact[1][0][a:b], exact[1][1][a:b]
        distance = (k1 - placed[1][0]).square().sum((1, 2)) \
            + (v1 - placed[1][1]).square().sum((1, 2))
        keep = -(-(b - a) // 4)
        want = set(torch.topk(distance, keep).indices.tolist())
        recomputed += keep
        for layer in (2, 3):
            moved = (request_kv[layer][0][a:b] - placed[layer][0]).abs().amax((1, 2)) > 1e-4
            assert set(moved.nonzero().squeeze(1).tolist()) == want
            kept = torch.tensor(sorted(set(range(b - a)) - want))
            torch.testing.assert_close(request_kv[layer][0][a:b][kept], placed[layer][0][kept],
                                       atol=2e-5, rtol=1e-4)
            assert torch.equal(request_kv[layer][1][a:b][kept], placed[layer][1][kept])
    counters = llm.engine.scheduler.blend.counters
    assert counters.recomputed_tokens == recomputed


def test_unmarked_prompts_and_their_neighbours_are_unchanged(llama_dir):
    """Blending on changes nothing for prompts without documents, nor for plain requests that
    share steps with blended ones."""
    prompts = _rag(seed=4)
    plain = _plain(prompts) + [{"prompt_token_ids": p} for p in random_prompts([40, 25], 512,
                                                                                seed=9)]
    off = LLM(model=str(llama_dir), block_size=8, seed=0)
    want = [o.outputs[0].token_ids for o in generate_checked(off, plain, GREEDY)]
    on = _blend_llm(llama_dir, 0.15)
    assert [o.outputs[0].token_ids for o in generate_checked(on, plain, GREEDY)] == want
    assert on.engine.scheduler.blend.counters.blended_requests == 0
    on = _blend_llm(llama_dir, 0.15, enable_chunked_prefill=True, max_num_batched_tokens=64)
    mixed = generate_checked(on, prompts + plain, GREEDY)
    assert on.engine.scheduler.blend.counters.blended_requests > 0
    assert [o.outputs[0].token_ids for o in mixed[len(prompts):]] == want


def test_blended_kv_is_never_published_and_reused_tokens_are_counted(llama_dir):
    llm = _blend_llm(llama_dir, 0.15)
    prompts = _rag(seed=5)
    generate_checked(llm, prompts[:1], GREEDY)
    params = SamplingParams(max_tokens=4, kv_cache_report=True)
    out = generate_checked(llm, prompts[1:2], params)[0]
    first_doc_end = prompts[1]["documents"][0][1]
    report = out.kv_cache_report["documents"]
    assert report["reused_tokens"] > 0 and report["recomputed_tokens"] > 0
    assert out.num_cached_tokens == out.kv_cache_report["cached_tokens"] + report["reused_tokens"]
    # The same tokens unmarked find at most exact blocks: the anchor (the text before the
    # first document) and that document, as its document request computed them.
    from kvserve.request import Request

    probe = Request("probe", out.prompt_token_ids + out.outputs[0].token_ids, params, 1)
    match = llm.engine.kv.device_match(probe)
    assert match.num_full_blocks * 8 <= first_doc_end


def test_documents_come_back_from_a_storage_tier(llama_dir, tmp_path):
    """A document's KV saved to disk (write-through) serves later requests after the device
    cache and host memory are wiped: the document requests load it from disk. The prompts
    share no 16-token chunk but through their documents (each starts with another document
    after a 12-token system text), so every disk hit is a document's. With every reused token
    recomputed the outputs stay transformers'."""
    llm = LLM(model=str(llama_dir), block_size=8, seed=0,
              blend_config={"recompute_fraction": 1.0},
              kv_tier_config={"chunk_size": 16, "local_cpu": True,
                              "local_disk": str(tmp_path), "max_local_disk_size": 0.01,
                              "write_policy": "write_through"})
    prompts = _rag(seed=8)
    generate_checked(llm, prompts[:1], GREEDY)
    assert llm.engine.tiers.flush()
    llm.reset_prefix_cache()
    llm.engine.tiers.clear(["host"])
    outs = generate_checked(llm, prompts[1:], GREEDY)
    assert llm.engine.stats().hit_tokens["disk"] >= 16
    assert llm.engine.scheduler.blend.counters.blended_requests >= 2
    want = hf_greedy(llama_dir, [p["prompt_token_ids"] for p in prompts[1:]], GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_the_engines_own_request_ids_are_refused(llama_dir):
    """Document requests and audit twins have ids of their own: a caller cannot take one."""
    from kvserve.blend.audit import TWIN_ID_PREFIX
    from kvserve.blend.blender import DOC_ID_PREFIX

    llm = _blend_llm(llama_dir, 0.15)
    for rid in (f"{DOC_ID_PREFIX}0", f"{TWIN_ID_PREFIX}0"):
        with pytest.raises(ValueError, match="are the engine's own"):
            llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id=rid)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


def test_preemption_and_a_small_pool_lose_nothing(llama_dir):
    """Blended requests that preempt each other (recompute) and documents evicted before
    their request is admitted: with everything recomputed the outputs stay exact."""
    prompts = _rag(seed=6) * 2
    pool = 30 * 8 * kv_bytes_per_token(llama_dir)
    llm = _blend_llm(llama_dir, 1.0, kv_cache_memory_bytes=pool)
    outs = generate_checked(llm, prompts, GREEDY)
    want = hf_greedy(llama_dir, [p["prompt_token_ids"] for p in prompts[:3]], GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 or llm.engine.scheduler.blend.counters.fallbacks > 0


def test_audits_measure_divergence_and_turn_blending_off(llama4_dir):
    """Every blended request audited: its twins return nothing, the divergence is recorded
    (KL against the exact distribution, checked here from the twins' own logprobs' formula on
    a made-up pair), and past the threshold blending stops: later requests compute exactly."""
    from kvserve.blend.audit import kl_top

    assert kl_top({1: 0.0}, {1: 0.0}) == 0.0
    # over tokens 1, 2: exact (0.9048, 0.0907) and blended (0.6065, 0.3679: token 2 missing,
    # given the blended floor e^-1), each renormalised
    e = torch.tensor([0.9048, 0.0907]) / 0.9955
    b = torch.tensor([0.6065, 0.3679]) / 0.9744
    assert kl_top({1: -0.1, 2: -2.4}, {1: -0.5, 3: -1.0}) == pytest.approx(
        float((e * (e / b).log()).sum()), abs=1e-3)
    prompts = _rag(seed=7)
    llm = LLM(model=str(llama4_dir), block_size=8, seed=0,
              blend_config={"recompute_fraction": 0.0, "audit_rate": 1.0,
                            "audit_threshold": 1e-9, "min_audits": 1})
    outs = generate_checked(llm, prompts[:2], GREEDY)
    assert len(outs) == 2
    stats = llm.engine.stats().blend
    assert stats["audits"] >= 1 and stats["audit_divergence_mean"] > 0
    assert stats["enabled"] == 0
    blended = stats["blended_requests"]
    generate_checked(llm, prompts[2:], GREEDY)
    assert llm.engine.stats().blend["blended_requests"] == blended  # off: computed exactly
    # A generous threshold keeps it on.
    llm = LLM(model=str(llama4_dir), block_size=8, seed=0,
              blend_config={"recompute_fraction": 0.0, "audit_rate": 1.0,
                            "audit_threshold": 1e6, "min_audits": 1})
    generate_checked(llm, prompts, GREEDY)
    assert llm.engine.stats().blend["enabled"] == 1 and llm.engine.stats().blend["audits"] >= 1
