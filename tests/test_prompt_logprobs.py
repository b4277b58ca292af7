"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) against transformers' log_softmax of
its own logits on the same ids, for every architecture: plain, with chunked prefill, with the
prefix already cached by an earlier request, with n > 1 in a batch of requests that don't ask,
and across a preemption; plus validation and the untouched path of requests that don't ask."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_checked, kv_bytes_per_token, random_prompts

from kvserve import LLM, SamplingParams
from kvserve.outputs import RequestOutput
from kvserve.sampling import MAX_LOGPROBS

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
LENGTHS = [1, 2, 19, 57, 130]
VOCAB = 512
TOP = 5
TOL = 1e-4
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def references(hf_checkpoints) -> dict[str, tuple[list[list[int]], list[torch.Tensor]]]:
    """Per architecture: prompts and transformers' log_softmax over each prompt, one prompt
    at a time (row i predicts token i + 1)."""
    import transformers

    refs = {}
    for arch in ARCHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoints[arch],
                                                                  dtype=torch.float32)
        prompts = random_prompts(LENGTHS, VOCAB, seed=10 + ARCHS.index(arch))
        with torch.no_grad():
            lps = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)
                   for p in prompts]
        refs[arch] = (prompts, lps)
    return refs


def max_diff(out: RequestOutput, prompt: list[int], ref: torch.Tensor, top: int) -> float:
    """Check the output's shape and ids against the reference; return the largest logprob
    difference (the actual tokens' and the top-k's)."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    assert len(out.prompt_logprob_ranks) == len(prompt) and out.prompt_logprob_ranks[0] is None
    worst = 0.0
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        token = prompt[i]
        assert token in entry
        assert next(iter(entry)) == token, "the actual token comes first"
        worst = max(worst, abs(entry[token] - row[token].item()))
        # its rank in transformers' distribution (a near-tie within the tolerance may go
        # either way)
        v = row[token].item()
        rank = out.prompt_logprob_ranks[i]
        assert int((row > v + TOL).sum()) + 1 <= rank <= int((row > v - TOL).sum()) + 1
        values, ids = row.topk(top)
        assert set(ids.tolist()) <= set(entry)
        assert len(entry) == top + (token not in ids.tolist())
        for t, v in zip(ids.tolist(), values.tolist()):
            worst = max(worst, abs(entry[t] - v))
    return worst


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params) -> list[RequestOutput]:
    return generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], params)


def _assert_parity(outs, prompts, refs, top: int = TOP) -> None:
    for out, p, ref in zip(outs, prompts, refs):
        assert max_diff(out, p, ref, top) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_plain(arch, hf_checkpoints, references):
    prompts, refs = references[arch]
    outs = _run(_llm(hf_checkpoints[arch]), prompts, PARAMS)
    _assert_parity(outs, prompts, refs)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(arch, hf_checkpoints, references):
    """Prompts span several steps (24 tokens per step), so logprobs are gathered per chunk."""
    prompts, refs = references[arch]
    llm = _llm(hf_checkpoints[arch], max_num_batched_tokens=24, max_num_seqs=4)
    steps = []
    original = llm.engine.scheduler.schedule

    def spy():
        batch = original()
        steps.append(batch.total_tokens)
        return batch

    llm.engine.scheduler.schedule = spy
    outs = _run(llm, prompts, PARAMS)
    assert max(steps) <= 24 and len(steps) > sum(LENGTHS) // 24
    _assert_parity(outs, prompts, refs)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix(arch, hf_checkpoints, references):
    """Another request cached the prompts (and a longer one sharing a prefix) first: the
    logprobs are still those of the whole prompt, because such a request reads nothing from
    the cache, while a request that does not ask still hits."""
    prompts, refs = references[arch]
    llm = _llm(hf_checkpoints[arch])
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    _run(llm, prompts + [prompts[-1] + [7, 8, 9]], plain)
    outs = _run(llm, prompts, PARAMS)
    _assert_parity(outs, prompts, refs)
    assert all(o.num_cached_tokens == 0 for o in outs)
    again = _run(llm, [prompts[-1]], plain)[0]
    assert again.num_cached_tokens >= 128, "the prefix was not in the cache"


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_and_n(arch, hf_checkpoints, references):
    """n = 2 and different k next to requests without prompt logprobs (one with sample
    logprobs) in the same steps; only the requests that ask get them."""
    prompts, refs = references[arch]
    llm = _llm(hf_checkpoints[arch])
    engine = llm.engine
    asks = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=3, prompt_logprobs=k)
            for i, k in enumerate([0, 1, 3, 20, 2])]
    ids = [engine.add_request({"prompt_token_ids": p}, a) for p, a in zip(prompts, asks)]
    others = [engine.add_request({"prompt_token_ids": p},
                                 SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))
              for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    for rid, p, ref, a in zip(ids, prompts, refs, asks):
        out = done[rid]
        assert len(out.outputs) == 2
        assert max_diff(out, p, ref, a.prompt_logprobs) <= TOL
    for rid in others:
        assert done[rid].prompt_logprobs is None
        assert done[rid].outputs[0].logprobs is not None


def test_preemption_keeps_one_entry_per_token(hf_checkpoints, references, monkeypatch):
    """A pool of 12 blocks of 8 tokens forces preemptions; a preempted request recomputes its
    prompt without recording its logprobs twice."""
    prompts, refs = references["qwen2"]
    path = hf_checkpoints["qwen2"]
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=8,
              kv_cache_memory_bytes=20 * 8 * kv_bytes_per_token(path))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    chosen = [p for p in prompts if len(p) < 100] * 2
    outs = _run(llm, chosen, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool forced no preemption"
    ref_of = {tuple(p): r for p, r in zip(prompts, refs)}
    for out, p in zip(outs, chosen):
        assert max_diff(out, p, ref_of[tuple(p)], 2) <= TOL


def test_requests_that_do_not_ask_compute_logits_only_where_they_sample(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16)
    model = llm.engine.model
    rows: list[int] = []
    original = model.compute_logits

    def spy(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    model.compute_logits = spy
    outs = _run(llm, random_prompts([40, 60], 256), SamplingParams(max_tokens=2))
    assert all(o.prompt_logprobs is None for o in outs)
    assert rows == [2, 2]


@pytest.mark.parametrize("value", [-1, 1.0, "2", True, MAX_LOGPROBS + 1])
def test_invalid_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_max_logprobs_is_allowed():
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS


def test_a_request_whose_prompt_logprobs_raise_fails_alone(hf_checkpoints, references):
    """Should computing one request's prompt logprobs raise, that request alone finishes with
    "error"; its neighbours (with and without prompt logprobs) go on."""
    prompts, refs = references["llama"]
    llm = _llm(hf_checkpoints["llama"])
    engine = llm.engine
    bad = [9, 9, 9, 9, 9, 9]
    original = engine.runner.sampling.sampler.token_logprobs

    def flaky(logits, token_ids, num_top):
        if list(token_ids[:3]) == bad[1:4]:
            raise RuntimeError("injected")
        return original(logits, token_ids, num_top)

    engine.runner.sampling.sampler.token_logprobs = flaky
    ids = [engine.add_request({"prompt_token_ids": p}, PARAMS) for p in (bad, prompts[3])]
    plain = engine.add_request({"prompt_token_ids": prompts[4]},
                               SamplingParams(temperature=0.0, max_tokens=2))
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done[ids[0]].outputs[0].finish_reason == "error"
    assert "injected" in done[ids[0]].error
    assert max_diff(done[ids[1]], prompts[3], refs[3], TOP) <= TOL
    assert done[plain].outputs[0].finish_reason == "length" and done[plain].error is None
    assert engine.kv.num_available_blocks == engine.kv.num_blocks


# -- prefill only (max_tokens 0) -------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_only_scores_the_prompt_and_samples_nothing(arch, hf_checkpoints, references):
    """max_tokens 0 with prompt_logprobs (what an OpenAI echo + max_tokens 0 request becomes):
    the prompt's logprobs match transformers, nothing is sampled, the finish reason is
    "length", in chunks (24 tokens a step) and next to requests that generate; every block
    goes back (generate_checked), the LM head runs only on prompt rows, and the full blocks
    stay cached for the next request."""
    prompts, refs = references[arch]
    llm = _llm(hf_checkpoints[arch], max_num_batched_tokens=24, max_num_seqs=4)
    sampled_rows: list[int] = []
    original = llm.engine.runner.sampling.sampler.__call__

    class Spy(type(llm.engine.runner.sampling.sampler)):
        def __call__(self, logits, rows, token_bitmask=None):
            sampled_rows.append(len(rows))
            return original(logits, rows, token_bitmask)

    llm.engine.runner.sampling.sampler.__class__ = Spy
    score = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=TOP, n=2)
    outs = _run(llm, prompts, score)
    assert not sampled_rows, "a prefill-only request was sampled"
    for out, p, ref in zip(outs, prompts, refs):
        assert max_diff(out, p, ref, TOP) <= TOL
        assert [c.token_ids for c in out.outputs] == [[], []]
        assert [c.text for c in out.outputs] == ["", ""]
        assert [c.finish_reason for c in out.outputs] == ["length", "length"]
        assert out.metrics.first_token_time is not None
    mixed = _run(llm, [prompts[4], prompts[3]], SamplingParams(temperature=0.0, max_tokens=3,
                                                                ignore_eos=True))
    assert mixed[0].num_cached_tokens >= 128 and len(mixed[0].outputs[0].token_ids) == 3


def test_prefill_only_without_logprobs_and_at_the_context_limit(tiny_model_dir):
    """max_tokens 0 alone is a plain prefill (nothing to sample, so the prompt may fill the
    whole context); one token more than max_model_len is still refused and leaves nothing."""
    llm = LLM(model=str(tiny_model_dir), max_model_len=64, block_size=16)
    prompt = random_prompts([64], 256)[0]
    out = _run(llm, [prompt], SamplingParams(max_tokens=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs is None
    with pytest.raises(ValueError, match="max_model_len"):
        llm.engine.add_request({"prompt_token_ids": prompt + [5]}, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.num_blocks


def test_prompt_logprobs_after_a_sampled_request(tiny_model_dir):
    """The sampler's workspace made while sampling (inside inference mode) is reused by the
    prompt logprobs of a later request: that must not raise (it did: "Inplace update to
    inference tensor outside InferenceMode")."""
    llm = LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16)
    _run(llm, random_prompts([20], 256), SamplingParams(temperature=1.0, max_tokens=2))
    out = _run(llm, random_prompts([30], 256, seed=1), SamplingParams(max_tokens=1,
                                                                      prompt_logprobs=2))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_logprobs) == 30
