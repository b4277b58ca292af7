"""The offline API: argument names, outputs, sampling controls, and refusal of bad input."""

from __future__ import annotations

import logging
import re

import pytest
from helpers import generate_checked, kv_bytes_per_token, random_prompts

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16, seed=0)


def _ids(llm, n, length=8, seed=0):
    return [{"prompt_token_ids": p}
            for p in random_prompts([length] * n, llm.engine.model_config.vocab_size, seed)]


def test_outputs_in_input_order_with_metrics(llm):
    prompts = ["hello world", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "abc"}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outs] == ["hello world", None, "abc"]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 5 and c.finish_reason == "length"
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.num_cached_tokens == 0 and o.finished
        assert isinstance(c.text, str)
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.num_blocks


def test_text_is_detokenized_output(llm):
    out = llm.generate("The capital of France is",
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_chat_applies_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                          add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 3


def test_n_samples_and_seeds(llm):
    prompt = _ids(llm, 1)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) > 1, "n samples should differ"
    # the same seeded request gives the same tokens alone and inside a busy batch
    again = llm.generate([prompt] + _ids(llm, 5, seed=9), params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_a_seeded_request_draws_the_same_tokens_when_preempted(tiny_model_dir, llm):
    """The worker keeps each request's sampling state (its generator included) from its first
    step until it finishes, preemptions included: seeded random samples in a pool so small that
    requests are preempted and recomputed equal those of a roomy pool."""
    prompts = _ids(llm, 6, length=40, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=7, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16, seed=0,
                kv_cache_memory_bytes=20 * 16 * kv_bytes_per_token(tiny_model_dir))
    tight = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert tight == roomy
    assert len(small.engine.runner.sampling) == 0  # the worker forgot every finished request


def test_stop_string_and_stop_token(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = llm.generate("Once upon a time", params)[0].outputs[0]
    # a stop string taken from the middle of the greedy text
    text = base.text
    assert len(text) > 10
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                      stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    keep = llm.generate("Once upon a time",
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                       include_stop_str_in_output=True))[0].outputs[0]
    assert keep.text == text[:cut + len(stop)]
    # a stop token id: generation ends right after it
    token = base.token_ids[4]
    first = base.token_ids.index(token)
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                      stop_token_ids=[token]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_min_tokens_and_logprobs(llm):
    prompt = _ids(llm, 1)[0]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    stop_tok = first.token_ids[0]
    # Without min_tokens the first token stops the request; with it, the token is masked until
    # 3 tokens exist, so it cannot appear among the first two.
    short = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert short.token_ids == [stop_tok] and short.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[stop_tok],
                            logprobs=2)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert len(out.token_ids) >= 3 and stop_tok not in out.token_ids[:2]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 2 <= len(lp) <= 3
        assert all(v <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in
                                                       zip(out.token_ids, out.logprobs)))


def test_startup_log_line(tiny_model_dir, caplog):
    logger = logging.getLogger("kvserve")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kvserve"):
            LLM(model=str(tiny_model_dir), max_model_len=128, block_size=16,
                kv_cache_memory_bytes=100 * 16 * kv_bytes_per_token(tiny_model_dir))
    finally:
        logger.removeHandler(caplog.handler)
    line = next(r.getMessage() for r in caplog.records if "KV cache size" in r.getMessage())
    assert re.fullmatch(r"KV cache size: 1,600 tokens, Maximum concurrency for 128 tokens per "
                        r"request: 12\.50x", line), line


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -1]}, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, "list of integers"),
    (42, "a prompt must be"),
    ({"prompt_token_ids": [3] * 256}, "max_model_len"),
])
def test_bad_prompts_are_refused(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.num_blocks


def test_prompt_plus_max_tokens_beyond_max_model_len(llm):
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate({"prompt_token_ids": [3] * 200}, SamplingParams(max_tokens=100))


def test_request_that_never_fits_the_pool(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16,
                kv_cache_memory_bytes=4 * 16 * kv_bytes_per_token(tiny_model_dir))
    with pytest.raises(ValueError, match="KV pool has only 4 blocks"):
        small.generate({"prompt_token_ids": [3] * 60}, SamplingParams(max_tokens=10))
    # a request that fits still runs afterwards
    out = small.generate({"prompt_token_ids": [3] * 20}, SamplingParams(max_tokens=10))
    assert len(out[0].outputs[0].token_ids) >= 1


def test_one_bad_prompt_refuses_the_whole_call(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [4, 5]}, ""], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
    dict(max_tokens=-1), dict(n=0), dict(repetition_penalty=0), dict(presence_penalty=3),
    dict(frequency_penalty=-2.5), dict(min_tokens=5, max_tokens=2), dict(logprobs=-1),
    dict(stop=[""]), dict(stop_token_ids=[-3]), dict(temperature=float("nan")),
])
def test_invalid_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(block_size=0), ValueError), (dict(max_num_seqs=-1), ValueError),
    (dict(gpu_memory_utilization=1.5), ValueError), (dict(dtype="int3"), ValueError),
    (dict(not_an_arg=1), TypeError), (dict(max_model_len=10**9), ValueError),
])
def test_invalid_engine_args(tiny_model_dir, kwargs, exc):
    with pytest.raises(exc):
        LLM(model=str(tiny_model_dir), **kwargs)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json|does not exist|not found"):
        LLM(model=str(tmp_path / "nope"))


def test_preemption_counts_and_completes(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), max_model_len=128, block_size=4, max_num_seqs=8,
                kv_cache_memory_bytes=20 * 4 * kv_bytes_per_token(tiny_model_dir))
    prompts = _ids(small, 6, length=12)
    outs = generate_checked(small, prompts,
                            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == small.engine.scheduler.num_preemptions
    # preempted or not, each output equals the request run alone
    for p, o in zip(prompts, outs):
        alone = small.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert alone[0].outputs[0].token_ids == o.outputs[0].token_ids
