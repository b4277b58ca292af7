"""Issue 11 (reliability): what one request may cost, and that it costs only itself.

In process: a request that raises while it is sampled or detokenized fails alone (finish_reason
"error", blocks freed) and its neighbours finish with the text they get when run alone; text
that cannot be encoded, out-of-vocabulary stop ids and over-long text are refused at
`add_request`. Against a real server (small limits, --api-key-protect-all): lone surrogates in
any field, body size (413), sequences per request and the waiting limit (400 when it can never
fit, 429 only when it could later), echo truncation, the validation messages that name their
limit, and which routes the API key guards.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from test_server import ServerProcess, _assert_error_shape

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 1_000_000
C, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "Kernels and caches"]


# ------------------------------------------------------------------------------------------
# the engine: validation and fault isolation
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16, seed=0)


@pytest.fixture(scope="module")
def alone(llm) -> dict[str, str]:
    """Each prompt's greedy text when run by itself."""
    return {p: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].text for p in PROMPTS}


def _run_all(engine, requests: list[tuple[str, SamplingParams]]) -> dict[str, object]:
    ids = {engine.add_request(p, params, stream=True): p for p, params in requests}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
    assert engine.kv.num_available_blocks == engine.kv.num_blocks, "KV blocks leaked"
    return done


def test_unencodable_text_and_oov_ids_are_refused_at_add_request(llm):
    engine = llm.engine
    cases = [(dict(prompt="hi", cache_salt="\ud800"), "cache_salt"),
             (dict(prompt="bad \udc00 text"), "surrogate"),
             (dict(prompt={"prompt": "x\ud800", "prompt_token_ids": [5, 6]}), "surrogate"),
             (dict(prompt="hi", params=SamplingParams(stop_token_ids=[10**6])), "[0, "),
             (dict(prompt="word " * 2000), "at least")]
    for kwargs, words in cases:
        with pytest.raises(ValueError) as info:
            engine.add_request(**kwargs)
        assert words in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="stop string"):
        SamplingParams(stop=["ok", "\ud800"])
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("where", ["add", "flush"])
def test_a_failing_detokenizer_fails_only_its_request(llm, alone, monkeypatch, where):
    """`add` runs for every token (LLMEngine._append_token); `flush` once, when the output of
    the finished request is built (LLMEngine._output)."""
    from kvserve.engine import llm_engine

    real = llm_engine.IncrementalDetokenizer

    class Exploding(real):
        def add(self, token_id: int) -> str:
            if where == "add" and self.prompt_ids_len == POISONED:
                raise RuntimeError("detokenizer fault")
            return super().add(token_id)

        def flush(self) -> str:
            if where == "flush" and self.prompt_ids_len == POISONED:
                raise RuntimeError("detokenizer fault")
            return super().flush()

        def __init__(self, tokenizer, prompt_ids=(), *args, **kwargs):
            super().__init__(tokenizer, prompt_ids, *args, **kwargs)
            self.prompt_ids_len = len(prompt_ids)

    POISONED = len(llm.engine.tokenizer.encode("poisoned request here"))
    assert POISONED not in {len(llm.engine.tokenizer.encode(p)) for p in PROMPTS}
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", Exploding)
    done = _run_all(llm.engine, [(p, GREEDY) for p in PROMPTS]
                    + [("poisoned request here", SamplingParams(max_tokens=12, n=2))])
    bad = done["poisoned request here"]
    assert bad.finished and "detokenizer fault" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    for p in PROMPTS:
        assert done[p].error is None and done[p].outputs[0].finish_reason == "length"
        assert done[p].outputs[0].text == alone[p]


class _FaultySampler:
    """The engine's sampler, raising whenever a row of seed 666 is in the batch."""

    def __init__(self, real) -> None:
        self.real = real

    def __call__(self, logits, rows, token_bitmask=None):
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("sampler fault")
        return self.real(logits, rows, token_bitmask)


def test_a_failing_sampler_row_fails_only_its_request(llm, alone, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine, "sampler", _FaultySampler(engine.sampler))
    done = _run_all(engine, [(p, GREEDY) for p in PROMPTS]
                    + [("the bad one", SamplingParams(seed=666, max_tokens=5))])
    assert "sampler fault" in done["the bad one"].error
    for p in PROMPTS:
        assert done[p].outputs[0].text == alone[p]


def test_async_engine_delivers_a_request_error_to_that_request_only(llm, alone, monkeypatch):
    from kvserve.engine.async_engine import AsyncLLMEngine, EngineRequestError

    engine = llm.engine
    monkeypatch.setattr(engine, "sampler", _FaultySampler(engine.sampler))

    async def collect(ae, prompt, params, rid):
        return [o async for o in ae.generate(prompt, params, rid)][-1]

    async def main():
        ae = AsyncLLMEngine(engine, log_stats=False)
        ae.start()
        try:
            return await asyncio.gather(
                *(collect(ae, p, GREEDY, f"ok{i}") for i, p in enumerate(PROMPTS)),
                collect(ae, "bad", SamplingParams(seed=666, max_tokens=4), "bad"),
                return_exceptions=True)
        finally:
            ae.shutdown()

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(results[-1], EngineRequestError) and "sampler fault" in str(results[-1])
    assert [r.outputs[0].text for r in results[:-1]] == [alone[p] for p in PROMPTS]
    assert engine.kv.num_available_blocks == engine.kv.num_blocks


# ------------------------------------------------------------------------------------------
# the server
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess("limits", ["--api-key", API_KEY, "--api-key-protect-all",
                                    "--max-seqs-per-request", "64",
                                    "--max-waiting-requests", "32",
                                    "--max-request-body-bytes", str(BODY_LIMIT)],
                         tmp_path_factory.mktemp("limits-logs"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        code = proc.stop()
    assert code is None, proc.log()[-3000:]


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    if not isinstance(body, (dict, list)):  # raw bytes, or an iterator of them (chunked)
        return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers={**AUTH, "content-type": "application/json"}, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, headers=AUTH, **kwargs)


SURROGATE = "\\ud800"  # as JSON text: a lone surrogate escape
SURROGATE_BODIES = [
    (C, '{"prompt": "hi", "cache_salt": "%s"}'),
    (C, '{"prompt": "hi", "model": "%s"}'),
    (C, '{"prompt": "a%sb"}'),
    (C, '{"prompt": ["fine", "%s"]}'),
    (C, '{"prompt": "hi", "stop": ["%s"]}'),
    (C, '{"prompt": "hi", "user": "%s"}'),
    (CHAT, '{"messages": [{"role": "user", "content": "%s"}]}'),
    (CHAT, '{"messages": [{"role": "%s", "content": "hi"}]}'),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "%s"}]}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "x": {"%s": 1}}'),
]


def test_lone_surrogates_are_400_and_spare_a_running_stream(server):
    async def main():
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            body = {"prompt": "a stream alongside", "max_tokens": 40, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            async with http.stream("POST", f"{server.url}{C}", json=body) as stream:
                bad = await asyncio.gather(*(http.post(
                    f"{server.url}{path}", content=(template % SURROGATE).encode(),
                    headers={"content-type": "application/json"})
                    for path, template in SURROGATE_BODIES))
                lines = [line async for line in stream.aiter_lines() if line]
            return bad, lines

    bad, lines = asyncio.run(asyncio.wait_for(main(), 120))
    for r, (path, template) in zip(bad, SURROGATE_BODIES):
        err = _assert_error_shape(r, 400)
        assert "Unicode" in err["message"], (template, err)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)


def test_body_size_limit_gives_413(server):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    err = _assert_error_shape(_post(server, C, big), 413)
    assert "--max-request-body-bytes" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    _assert_error_shape(_post(server, C, chunks()), 413)
    assert _post(server, C, {"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_text_that_cannot_fit_is_refused_without_tokenizing(server):
    t0 = time.monotonic()
    err = _assert_error_shape(_post(server, C, {"prompt": "x" * 900_000}), 400)
    assert "at least" in err["message"] and "max_model_len" in err["message"]
    err = _assert_error_shape(_post(server, CHAT, {"messages": [
        {"role": "user", "content": "y" * 900_000}]}), 400)
    assert "at least" in err["message"]
    assert time.monotonic() - t0 < 10


def test_sequence_limits_400_when_never_fits(server):
    # more sequences than --max-seqs-per-request (64): 400 naming it, at once
    err = _assert_error_shape(_post(server, C, {"prompt": ["a"] * 8, "n": 9}), 400)
    assert "--max-seqs-per-request" in err["message"] and "72" in err["message"]
    # 2,048 prompts (the schema's bound) on an idle server: never fits, so 400 and not 429
    err = _assert_error_shape(_post(server, C, {"prompt": ["a"] * 2048}), 400)
    assert "2,048" in err["message"]
    # over the waiting limit (32) but within the per-request one: 400 naming the waiting limit
    err = _assert_error_shape(_post(server, C, {"prompt": ["a"] * 10, "n": 4}), 400)
    assert "--max-waiting-requests" in err["message"]
    ok = _post(server, C, {"prompt": ["a"] * 8, "n": 4, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 32


def test_messages_name_the_limit_and_echo_is_truncated(server):
    err = _assert_error_shape(_post(server, C, {"prompt": "hi", "model": "m" * 900_000}),
                              404)
    assert len(err["message"]) < 200 and "…" in err["message"]
    err = _assert_error_shape(_post(server, C, {"prompt": "hi",
                                                "stop": [f"s{i}" for i in range(17)]}), 400)
    assert "16" in err["message"]
    err = _assert_error_shape(_post(server, C, {"prompt": [1, -2, 3]}), 400)
    assert "greater than or equal to 0" in err["message"] and "string" not in err["message"]
    err = _assert_error_shape(_post(server, C, {"prompt": "hi", "stop_token_ids": [10**6]}),
                              400)
    assert "stop_token_ids" in err["message"] and "vocabulary" in err["message"]


def test_api_key_protect_all_leaves_only_health_open(server):
    for path in ("/metrics", "/docs", "/openapi.json", "/version", "/v1/models"):
        _assert_error_shape(httpx.get(f"{server.url}{path}"), 401)
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path
    assert httpx.get(f"{server.url}/health").status_code == 200
