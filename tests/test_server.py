"""The OpenAI-compatible server, driven as a real process (`python -m kvserve.entrypoints.cli serve`) on the
tiny random-weight model (`ensure_default_model`), with the official `openai` client, raw HTTP for hostile input,
schemathesis against the server's own OpenAPI schema, and a 256-client streaming load."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.model_loader.make_model import ensure_default_model
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 512
API_KEY = "sk-kvserve-test"


# ------------------------------------------------------------------------------------------
# the server processes
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server-logs")
    # Both start at once, so their start-ups overlap.
    tiny = str(ensure_default_model())
    # keyless, its callers made the admin: /reset_prefix_cache is tested on it
    main = ServerProcess("main", [tiny, "--served-model-name", "tiny", "kvserve-tiny",
                                  "--log-stats-interval", "1", "--allow-unauthenticated-admin"],
                         log_dir)
    limited = ServerProcess("limited", [tiny, "--served-model-name", "default",
                                        "--api-key", API_KEY, "--max-num-seqs", "1",
                                        "--max-waiting-requests", "2"], log_dir)
    try:
        main.wait_ready()
        limited.wait_ready()
        yield {"main": main, "limited": limited}
    finally:
        codes = {s.name: s.stop() for s in (main, limited)}
    # Nothing took a server down during the tests.
    assert codes == {"main": None, "limited": None}, (codes, main.log()[-3000:])


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_dir(ensure_default_model())


@pytest.fixture(scope="module")
def offline_llm():
    from kvserve import LLM

    return LLM(model=str(ensure_default_model()), max_model_len=MAX_MODEL_LEN)


def _unique_text(rng: random.Random, words: int) -> str:
    vocab = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
             "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
             "zulu kernel cache block token server batch").split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: the server has one model)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            key = sample.name
            if "finished_reason" in sample.labels:
                key += "{" + sample.labels["finished_reason"] + "}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


def _assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


# ------------------------------------------------------------------------------------------
# 1. the API through the official openai client
# ------------------------------------------------------------------------------------------

def test_models_health_and_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "kvserve-tiny"]
    assert client.models.retrieve("kvserve-tiny").id == "kvserve-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    err = _assert_error_shape(httpx.get(f"{server.url}/v1/models/no/such-model"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()


def test_completion_matches_offline_engine(client, offline_llm, tokenizer):
    from kvserve import SamplingParams

    prompt = "The quick brown fox jumps over the lazy dog and then"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert resp.object == "text_completion" and resp.model == "tiny"
    choice = resp.choices[0]
    assert choice.text == offline.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 10
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 10
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_applies_template(client, offline_llm, tokenizer):
    from kvserve import SamplingParams

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model="kvserve-tiny", messages=messages,
                                          max_completion_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    offline = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert resp.object == "chat.completion" and resp.model == "kvserve-tiny"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == offline.outputs[0].text
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == 6
    # max_tokens is the older name of the same limit; content parts are joined text
    resp2 = client.chat.completions.create(
        model="tiny", max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}])
    assert resp2.usage.completion_tokens <= 3


def test_streaming_completion_equals_non_streaming(client):
    kwargs = dict(model="tiny", prompt="Once upon a time, in a land far away,", max_tokens=24,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_chat(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
                  max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage unless include_usage


def test_a_stream_arrives_while_it_is_generated(server):
    """A stream is sent as it is generated, not as one body at the end: a 200-token completion
    comes in more than one piece. (A stream coalesces the outputs a slow reader has not taken
    yet, so this does not count pieces per token; 200 tokens take far longer than any stall of
    the reader here.)"""
    pieces: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            text = json.loads(line[len("data: "):])["choices"][0]["text"]
            if text:
                pieces.append(text)
    assert len(pieces) >= 2, f"the whole completion came as {len(pieces)} piece(s)"


def test_raw_sse_framing(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "hello", "max_tokens": 4, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_sse_events_stay_one_line_for_unicode_line_splitters(server):
    """NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR are line ends to str.splitlines() and so to
    httpx's aiter_lines; a generated token that decodes to one must not cut an event in two.
    The echoed prompt carries them into the stream verbatim, so this does not wait on the model
    to sample one (the 256-client test once did, and failed on the cut event)."""
    breakers = "a\x85b\u2028c\u2029d"
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": breakers, "max_tokens": 2, "stream": True, "echo": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    events = [e for e in body.splitlines() if e]
    assert all(e.startswith("data: ") for e in events), events
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(breakers)


def test_n_samples_and_batched_prompts(client):
    resp = client.completions.create(model="tiny", prompt="Pick a number:", n=3, max_tokens=6,
                                     temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1  # different samples
    assert resp.usage.completion_tokens == 18
    batch = client.completions.create(model="tiny", prompt=["first prompt", "second one"], n=2,
                                      max_tokens=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 12
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 6 and len(ids.choices) == 2
    streamed = list(client.completions.create(model="tiny", prompt=["a b c", "d e f"], n=2,
                                              max_tokens=5, stream=True,
                                              extra_body={"ignore_eos": True}))
    finished = sorted(c.choices[0].index for c in streamed if c.choices[0].finish_reason)
    assert finished == [0, 1, 2, 3]
    chat = client.chat.completions.create(model="tiny", n=2, max_tokens=4, seed=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="The capital of France is",
                                     max_tokens=6, logprobs=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely
        assert top[token] == pytest.approx(value)
    streamed = list(client.completions.create(model="tiny", prompt="The capital of France is",
                                              max_tokens=6, logprobs=3, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in streamed for t in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "Hello"}],
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        if item.token.startswith("bytes:"):  # part of a UTF-8 character: OpenAI's form
            assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)
        else:
            assert bytes(item.bytes).decode() == item.token
    plain = client.chat.completions.create(model="tiny", max_tokens=3, logprobs=True,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert all(item.top_logprobs == [] for item in plain.choices[0].logprobs.content)


def test_stop_strings_and_stop_token_ids(client):
    kwargs = dict(model="tiny", prompt="Write something long about kernels:", temperature=0,
                  extra_body={"ignore_eos": True})
    free = client.completions.create(max_tokens=40, **kwargs).choices[0].text
    assert len(free) > 20
    stop = free[10:14]
    cut = free.index(stop)
    stopped = client.completions.create(max_tokens=40, stop=[stop, "never-appears"], **kwargs)
    choice = stopped.choices[0]
    assert choice.text == free[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    # streaming holds back what could be the start of a stop string: same text, no leak
    streamed = list(client.completions.create(max_tokens=40, stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == free[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(client, offline_llm):
    from kvserve import SamplingParams

    prompt = "Write something long about caches:"
    ids = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[6]
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True,
                                                 "stop_token_ids": [stop_id]})
    choice = resp.choices[0]
    assert resp.usage.completion_tokens == ids.index(stop_id) + 1
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id


def test_seed_gives_the_same_text(client):
    kwargs = dict(model="tiny", prompt="Random words:", max_tokens=16, temperature=1.0,
                  top_p=0.95, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.0,
                                          "repetition_penalty": 1.1})
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert a == b
    assert a != c
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Say anything."}],
                max_tokens=12, temperature=0.9, presence_penalty=0.5, frequency_penalty=0.5)
    assert client.chat.completions.create(seed=99, **chat).choices[0].message.content == \
        client.chat.completions.create(seed=99, **chat).choices[0].message.content


def test_cached_tokens_on_a_repeated_prefix(client):
    prompt = _unique_text(random.Random(1), 80)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens > 150
    assert first.usage.prompt_tokens_details.cached_tokens < 16  # at most a chance overlap
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached >= second.usage.prompt_tokens - 16  # all but the last (partial) block
    # the same for chat, whose template puts a shared system prompt first
    system = _unique_text(random.Random(2), 60)
    chats = [client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "system", "content": system},
                                              {"role": "user", "content": q}])
        for q in ("first question", "second question")]
    assert chats[0].usage.prompt_tokens_details.cached_tokens < 16  # "<|im_start|>system\n"
    assert chats[1].usage.prompt_tokens_details.cached_tokens > 120


def test_cache_salt_separates_prefixes(client, server):
    prompt = _unique_text(random.Random(3), 60)
    salted = [client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                        extra_body={"cache_salt": salt})
              for salt in ("tenant-a", "tenant-a", "tenant-b")]
    assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
    assert salted[1].usage.prompt_tokens_details.cached_tokens > 120
    assert salted[2].usage.prompt_tokens_details.cached_tokens == 0  # another tenant: no hit
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                  extra_body={"cache_salt": ""})
    assert "cache_salt" in info.value.body["message"]


def test_reset_prefix_cache(client, server):
    prompt = _unique_text(random.Random(4), 50)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


# ------------------------------------------------------------------------------------------
# 4. /metrics
# ------------------------------------------------------------------------------------------

METRIC_NAMES = [
    "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
    "kvserve:kv_cache_usage_perc", "kvserve:num_requests_running",
    "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
    "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
    "kvserve:time_to_first_token_seconds_count", "kvserve:inter_token_latency_seconds_count",
    "kvserve:e2e_request_latency_seconds_count", "kvserve:request_queue_time_seconds_count",
    "kvserve:request_prefill_time_seconds_count", "kvserve:request_decode_time_seconds_count",
    "kvserve:request_inference_time_seconds_count",
]


def test_metrics_parse_and_prefix_counters_move(client, server):
    before = _metrics(server.url)
    for name in METRIC_NAMES:
        assert name in before, name
    shared = _unique_text(random.Random(5), 60)
    usages = [client.completions.create(model="tiny", prompt=f"{shared} question {i}",
                                        max_tokens=3, extra_body={"ignore_eos": True}).usage
              for i in range(3)]
    after = _metrics(server.url)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 2 * 150
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["kvserve:prefix_cache_queries_total"] == prompt_tokens
    assert d["kvserve:prefix_cache_hits_total"] == cached
    assert d["kvserve:prompt_tokens_total"] == prompt_tokens
    assert d["kvserve:generation_tokens_total"] == 9
    assert d["kvserve:time_to_first_token_seconds_count"] == 3
    assert d["kvserve:e2e_request_latency_seconds_count"] == 3
    assert d["kvserve:request_queue_time_seconds_count"] == 3
    for phase in ("prefill", "decode", "inference"):
        assert d[f"kvserve:request_{phase}_time_seconds_count"] == 3
    # queue + inference is the end-to-end latency of each request, so the sums agree
    parts = sum(d[f"kvserve:request_{p}_time_seconds_sum"] for p in ("queue", "inference"))
    assert abs(parts - d["kvserve:e2e_request_latency_seconds_sum"]) < 1e-3
    assert d["kvserve:request_prefill_time_seconds_sum"] > 0
    assert d["kvserve:inter_token_latency_seconds_count"] == 6
    assert d["kvserve:request_success_total{length}"] == 3
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------------------------------
# 2. malformed and hostile requests
# ------------------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
HOSTILE = [
    # (case id, path, JSON body or raw bytes, expected status)
    ("bad-json", C, b'{"prompt": "hi",', 400),
    ("bad-json-chat", CHAT, b'{"messages": [', 400),
    ("not-utf8", C, b'\xff\xfe{"prompt": 1}', 400),
    ("body-is-a-list", C, b"[1, 2, 3]", 400),
    ("body-is-a-string", C, b'"prompt"', 400),
    ("empty-body", C, b"", 400),
    ("nan-temperature", C, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("inf-top-p", C, b'{"prompt": "hi", "top_p": Infinity}', 400),
    ("missing-prompt", C, {"max_tokens": 3}, 400),
    ("missing-messages", CHAT, {"model": "tiny"}, 400),
    ("prompt-is-a-number", C, {"prompt": 42}, 400),
    ("prompt-is-an-object", C, {"prompt": {"text": "hi"}}, 400),
    ("prompt-mixed-list", C, {"prompt": ["hi", 3]}, 400),
    ("max-tokens-string", C, {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("max-tokens-float", C, {"prompt": "hi", "max_tokens": 2.5}, 400),
    ("temperature-string", C, {"prompt": "hi", "temperature": "hot"}, 400),
    ("stream-string", C, {"prompt": "hi", "stream": "yes"}, 400),
    ("n-bool", C, {"prompt": "hi", "n": True}, 400),
    ("messages-string", CHAT, {"messages": "hi"}, 400),
    ("messages-empty", CHAT, {"messages": []}, 400),
    ("message-without-role", CHAT, {"messages": [{"content": "hi"}]}, 400),
    ("message-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("message-image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ("empty-role", CHAT, {"messages": [{"role": "", "content": "hi"}]}, 400),
    ("huge-max-tokens", C, {"prompt": "hi", "max_tokens": 10**12}, 400),
    ("max-tokens-past-context", C, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400),
    ("chat-huge-max-completion-tokens", CHAT, {"messages": MSG,
                                               "max_completion_tokens": 10**9}, 400),
    ("negative-max-tokens", C, {"prompt": "hi", "max_tokens": -1}, 400),
    ("zero-max-tokens", C, {"prompt": "hi", "max_tokens": 0}, 400),
    ("negative-temperature", C, {"prompt": "hi", "temperature": -0.5}, 400),
    ("zero-top-p", C, {"prompt": "hi", "top_p": 0}, 400),
    ("top-p-above-one", C, {"prompt": "hi", "top_p": 1.5}, 400),
    ("negative-top-k", C, {"prompt": "hi", "top_k": -7}, 400),
    ("min-p-above-one", C, {"prompt": "hi", "min_p": 2.0}, 400),
    ("presence-penalty-out-of-range", C, {"prompt": "hi", "presence_penalty": 5}, 400),
    ("frequency-penalty-out-of-range", CHAT, {"messages": MSG, "frequency_penalty": -3}, 400),
    ("zero-repetition-penalty", C, {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("negative-n", C, {"prompt": "hi", "n": -1}, 400),
    ("zero-n", C, {"prompt": "hi", "n": 0}, 400),
    ("oversized-n", C, {"prompt": "hi", "n": 100000}, 400),
    ("oversized-n-chat", CHAT, {"messages": MSG, "n": 129}, 400),
    ("negative-logprobs", C, {"prompt": "hi", "logprobs": -1}, 400),
    ("too-many-logprobs", C, {"prompt": "hi", "logprobs": 1000}, 400),
    ("too-many-top-logprobs", CHAT, {"messages": MSG, "logprobs": True,
                                     "top_logprobs": 21}, 400),
    ("top-logprobs-without-logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400),
    ("negative-min-tokens", C, {"prompt": "hi", "min_tokens": -1}, 400),
    ("min-tokens-above-max", C, {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, 400),
    ("seed-too-wide", C, {"prompt": "hi", "seed": 2**70}, 400),
    ("stop-number", C, {"prompt": "hi", "stop": 5}, 400),
    ("stop-empty-string", C, {"prompt": "hi", "stop": ""}, 400),
    ("too-many-stops", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}, 400),
    ("negative-stop-token-id", C, {"prompt": "hi", "stop_token_ids": [-1]}, 400),
    ("logit-bias-out-of-range", C, {"prompt": "hi", "logit_bias": {"50": 100.5}}, 400),
    ("logit-bias-bad-key", C, {"prompt": "hi", "logit_bias": {"-5": 1}}, 400),
    ("logit-bias-word-key", CHAT, {"messages": MSG, "logit_bias": {"hello": 1}}, 400),
    ("logit-bias-out-of-vocab", C, {"prompt": "hi", "logit_bias": {str(10**6): 1}}, 400),
    ("logit-bias-string-value", C, {"prompt": "hi", "logit_bias": {"5": "1"}}, 400),
    ("unknown-field", C, {"prompt": "hi", "use_beam_search": True}, 400),
    # (chat's store is OpenAI's and accepted; OpenAI's completions have no store)
    ("unknown-field-chat", CHAT, {"messages": MSG, "use_beam_search": True}, 400),
    ("store-on-completions", C, {"prompt": "hi", "store": True}, 400),
    ("unknown-message-field", CHAT, {"messages": [{"role": "user", "content": "hi",
                                                   "weight": 1}]}, 400),
    ("stream-options-without-stream", C, {"prompt": "hi",
                                          "stream_options": {"include_usage": True}}, 400),
    ("unknown-stream-option", C, {"prompt": "hi", "stream": True,
                                  "stream_options": {"usage": True}}, 400),
    ("zero-max-tokens-chat", CHAT, {"messages": MSG, "max_tokens": 0}, 400),
    ("prompt-logprobs-streamed", C, {"prompt": "hi", "stream": True, "prompt_logprobs": 1},
     400),
    ("too-many-prompt-logprobs", CHAT, {"messages": MSG, "prompt_logprobs": 21}, 400),
    ("priority-without-priority-policy", C, {"prompt": "hi", "priority": 5}, 400),
    ("tool-without-function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400),
    ("tool-choice-auto", CHAT, {"messages": MSG, "tool_choice": "auto"}, 400),
    ("parallel-tool-calls-not-bool", CHAT, {"messages": MSG, "parallel_tool_calls": "no"}, 400),
    ("functions", CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400),
    ("function-call", CHAT, {"messages": MSG, "function_call": "auto"}, 400),
    ("history-tool-call-arguments-not-json", CHAT, {"messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"}]}, 400),
    ("guided-json", C, {"prompt": "hi", "guided_json": {"type": "object"}}, 400),
    ("guided-choice-chat", CHAT, {"messages": MSG, "guided_choice": ["a", "b"]}, 400),
    ("structured-outputs-bad-regex", C, {"prompt": "hi", "structured_outputs": {"regex": "(a"}},
     400),
    ("completion-unknown-response-format", C, {"prompt": "hi",
                                               "response_format": {"type": "xml"}}, 400),
    ("best-of", C, {"prompt": "hi", "best_of": 3}, 400),
    ("json-schema-without-schema", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("forced-tool-choice-without-tools", CHAT, {"messages": MSG, "tool_choice": "required"},
     400),
    ("unknown-model", C, {"model": "gpt-4", "prompt": "hi"}, 404),
    ("unknown-model-chat", CHAT, {"model": "gpt-4", "messages": MSG}, 404),
    ("empty-prompt", C, {"prompt": ""}, 400),
    ("empty-prompt-list", C, {"prompt": []}, 400),
    ("empty-prompt-in-batch", C, {"prompt": ["fine", ""]}, 400),
    ("empty-token-list-in-batch", C, {"prompt": [[1, 2], []]}, 400),
    ("out-of-vocab-token", C, {"prompt": [1, 2, 10**9]}, 400),
    ("negative-token-id", C, {"prompt": [1, -2, 3]}, 400),
    ("token-id-float", C, {"prompt": [1, 2.5]}, 400),
    ("prompt-too-long-ids", C, {"prompt": [5] * (MAX_MODEL_LEN + 10)}, 400),
    ("prompt-too-long-text", C, {"prompt": "word " * 5000}, 400),
    ("prompt-at-context-limit", C, {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}, 400),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, 400),
    ("empty-cache-salt", C, {"prompt": "hi", "cache_salt": ""}, 400),
    ("long-cache-salt", C, {"prompt": "hi", "cache_salt": "x" * 1000}, 400),
    ("cache-salt-number", C, {"prompt": "hi", "cache_salt": 12}, 400),
    ("priority-string", C, {"prompt": "hi", "priority": "high"}, 400),
    ("stream-options-string", C, {"prompt": "hi", "stream": True, "stream_options": "x"}, 400),
    ("bad-stream-request", C, {"prompt": "hi", "stream": True, "max_tokens": -3}, 400),
    ("bad-stream-chat", CHAT, {"messages": MSG, "stream": True, "temperature": -1}, 400),
    ("template-kwargs-not-dict", CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, 400),
]


@pytest.mark.parametrize("path,body,status", [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_openai_error(server, path, body, status):
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{path}", content=body, timeout=30,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    err = _assert_error_shape(r, status)
    if status == 404:
        assert err["param"] == "model" and err["code"] == "model_not_found"
    else:
        assert err["type"] == "invalid_request_error"


def test_other_http_errors_have_the_error_shape(server):
    _assert_error_shape(httpx.get(f"{server.url}/v1/completions"), 405)
    _assert_error_shape(httpx.get(f"{server.url}/no/such/route"), 404)
    r = httpx.post(f"{server.url}{C}", content=b'{"prompt": "hi"}', timeout=30,
                   headers={"content-type": "text/plain"})
    _assert_error_shape(r, 400)
    # a client that sends a body much larger than any prompt still gets a 400, not a crash
    r = httpx.post(f"{server.url}{C}", json={"prompt": [7] * 200_000}, timeout=60)
    _assert_error_shape(r, 400)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)


def _has_error_shape(path: str, body: dict) -> bool:
    """OpenAI's error object, or Anthropic's on /v1/messages."""
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and set(body.get("error", {})) == {"type", "message"}
    return set(body.get("error", {})) == {"message", "type", "param", "code"}


def test_schemathesis_fuzz_of_own_openapi_schema(server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    calls = {"n": 0}
    statuses: dict[tuple[str, str, int], int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=30, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                calls["n"] += 1
                response = case.call(base_url=server.url, timeout=60)
                status = response.status_code
                key = (operation.label, mode.value, status)
                statuses[key] = statuses.get(key, 0) + 1
                if status >= 500:
                    failures.append(f"{case.method} {case.path} {case.body!r:.300} -> {status} "
                                    f"{response.text[:300]}")
                elif status >= 400:
                    body = response.json()
                    if not _has_error_shape(case.path, body):
                        failures.append(f"{case.method} {case.path} {case.body!r:.300} -> "
                                        f"{status} without the error shape: {body!r:.300}")

            try:
                fuzz()
            except Unsatisfiable:
                # no negative input exists for an operation without parameters or body
                assert mode is GenerationMode.NEGATIVE, operation.label
    print(sorted(statuses.items()))
    # the pins a valid generated body made hold pool blocks: none outlives the fuzz (the tests
    # after it count the pool's blocks)
    _no_pins(server.url)
    assert not failures, "\n".join(failures[:10])
    assert calls["n"] > 100
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):  # valid ones got served
        assert statuses.get((op, "positive", 200), 0) > 0, statuses
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------------------------------
# the API key and the waiting-queue limit (a second server: --api-key, one sequence at a time)
# ------------------------------------------------------------------------------------------

def test_api_key(servers):
    url = servers["limited"].url
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        err = _assert_error_shape(httpx.post(f"{url}{C}", json=body, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    _assert_error_shape(httpx.get(f"{url}/v1/models"), 401)
    _assert_error_shape(httpx.post(f"{url}/reset_prefix_cache"), 401)
    # bad JSON without a key is still refused for the key first
    r = httpx.post(f"{url}{C}", content=b"{", headers={"content-type": "application/json"})
    _assert_error_shape(r, 401)
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model="default", prompt="hi", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{url}/health").status_code == 200  # open, as in vLLM
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_waiting_queue_limit_gives_429(servers):
    url = servers["limited"].url
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            body = {"prompt": "hold the line", "max_tokens": 500, "ignore_eos": True,
                    "stream": True}
            async with http.stream("POST", f"{url}{C}", json=body) as first:
                lines = first.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                # It runs (max-num-seqs 1): of the next ones, 2 may wait, the others are refused.
                rest = await asyncio.gather(*(http.post(f"{url}{C}", json=dict(
                    body, max_tokens=4, stream=False)) for _ in range(6)))
                tail = [line async for line in lines if line]
            return first, tail, rest

    first, tail, rest = asyncio.run(main())
    assert first.status_code == 200 and tail[-1] == "data: [DONE]"
    codes = sorted(r.status_code for r in rest)
    assert codes.count(200) == 2 and codes.count(429) == 4, codes
    for r in rest:
        if r.status_code == 429:
            assert _assert_error_shape(r, 429)["code"] == "rate_limit_exceeded"


# ------------------------------------------------------------------------------------------
# 3. load: 256 concurrent streaming clients; disconnects leave no KV blocks behind
# ------------------------------------------------------------------------------------------

async def _stream_one(http: httpx.AsyncClient, url: str, i: int) -> tuple[str, int, bool]:
    body = {"model": "tiny", "prompt": f"Client number {i} says", "max_tokens": 8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, tokens, done = "", 0, False
    async with http.stream("POST", f"{url}{C}", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            else:
                tokens = chunk["usage"]["completion_tokens"]
    return text, tokens, done


def _no_pins(url: str) -> None:
    """What the pool counts is what the requests hold: a pin an earlier test (the fuzz) left
    would hold blocks too, so the tests that count blocks start without any."""
    for pin in httpx.get(f"{url}/v1/cache/pins").json()["data"]:
        httpx.delete(f"{url}/v1/cache/pin/{pin['id']}")


def test_256_concurrent_streaming_clients(server):
    _no_pins(server.url)

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            t0 = time.monotonic()
            results = await asyncio.gather(*(_stream_one(http, server.url, i)
                                             for i in range(256)))
            return results, time.monotonic() - t0

    results, elapsed = asyncio.run(asyncio.wait_for(main(), 150))
    assert len(results) == 256
    assert all(done and tokens == 8 for _, tokens, done in results)
    assert sum(1 for text, _, _ in results if text) >= 250
    m = _metrics(server.url)
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0
    print(f"256 streaming clients x 8 tokens in {elapsed:.1f} s")
    # the periodic stats line (every second on this server, every 10 s by default)
    deadline = time.monotonic() + 5
    while "Avg prompt throughput" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.2)
    line = next(x for x in server.log().splitlines() if "Avg prompt throughput" in x)
    for part in ("Avg generation throughput", "Running:", "Waiting:", "KV cache usage:",
                 "Prefix cache hit rate:"):
        assert part in line, line


def test_disconnected_clients_leave_no_blocks(server):
    url = server.url
    before = _metrics(url)
    n_stream, n_plain, max_tokens = 24, 8, 450

    async def stream_then_leave(http, i):
        body = {"model": "tiny", "prompt": f"Disconnecting stream {i}", "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True}
        async with http.stream("POST", f"{url}{C}", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return True  # leave mid-stream: the connection closes on exit
        return False

    async def wait_then_leave(http, i):
        body = {"model": "tiny", "prompt": f"Impatient client {i}", "max_tokens": max_tokens,
                "ignore_eos": True}
        try:
            await asyncio.wait_for(http.post(f"{url}{C}", json=body), 0.3)
        except asyncio.TimeoutError:
            return True
        return False

    async def main():
        # fresh connections per client, so leaving really closes the socket
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            tasks = [asyncio.ensure_future(wait_then_leave(http, i)) for i in range(n_plain)]
            streamed = await asyncio.gather(*(stream_then_leave(http, i)
                                              for i in range(n_stream)))
            left = await asyncio.gather(*tasks)
        return streamed, left

    streamed, left = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(streamed) and all(left)
    deadline = time.monotonic() + 20
    while True:
        m = _metrics(url)
        if m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0 \
                and m["kvserve:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    generated = m["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    # They were stopped, not run to the end: far fewer tokens than they asked for.
    assert generated < 0.5 * (n_stream + n_plain) * max_tokens, generated
    # nothing finished normally: none of them counts as a success
    assert m.get("kvserve:request_success_total{length}", 0) == \
        before.get("kvserve:request_success_total{length}", 0)
    assert httpx.get(f"{url}/health").status_code == 200


def test_queued_clients_that_leave_are_dropped_from_the_queue(servers):
    """On the one-sequence server: while one stream runs, two clients queue behind it (one
    streaming, one not) and leave before their first token; they leave the queue at once."""
    url = servers["limited"].url
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def main():
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, headers=headers, limits=limits) as http:
            body = {"prompt": "running", "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with http.stream("POST", f"{url}{C}", json=body) as running:
                lines = running.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                queued_body = dict(body, prompt="queued", max_tokens=8)
                async with http.stream("POST", f"{url}{C}", json=queued_body) as queued:
                    assert queued.status_code == 200  # headers come at once, tokens later
                    plain = asyncio.ensure_future(http.post(
                        f"{url}{C}", json=dict(queued_body, stream=False)))
                    await asyncio.sleep(0.1)
                    waiting_then = _metrics(url)["kvserve:num_requests_waiting"]
                    plain.cancel()
                await asyncio.sleep(0.3)
                after = _metrics(url)
            return waiting_then, after

    waiting_then, after = asyncio.run(asyncio.wait_for(main(), 60))
    assert waiting_then == 2
    assert after["kvserve:num_requests_waiting"] == 0
    deadline = time.monotonic() + 10
    while (m := _metrics(url))["kvserve:num_requests_running"] or \
            m["kvserve:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
