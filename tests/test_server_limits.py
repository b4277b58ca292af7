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
import socket
import statistics
import threading
import time

import httpx
import pytest
from server_process import running
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
    """`add` runs for every token (LLMEngine._outputs, through the output processor's
    stop_string); `flush` once, when the output of the finished request is built
    (OutputProcessor.output)."""
    from kvserve.engine import output_processor

    real = output_processor.IncrementalDetokenizer

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
    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", Exploding)
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
    sampling = engine.runner.sampling  # the worker's sampler
    monkeypatch.setattr(sampling, "sampler", _FaultySampler(sampling.sampler))
    done = _run_all(engine, [(p, GREEDY) for p in PROMPTS]
                    + [("the bad one", SamplingParams(seed=666, max_tokens=5))])
    assert "sampler fault" in done["the bad one"].error
    for p in PROMPTS:
        assert done[p].outputs[0].text == alone[p]


def test_async_engine_delivers_a_request_error_to_that_request_only(llm, alone, monkeypatch):
    from kvserve.engine.async_engine import AsyncLLMEngine, EngineRequestError

    engine = llm.engine
    sampling = engine.runner.sampling  # the worker's sampler
    monkeypatch.setattr(sampling, "sampler", _FaultySampler(sampling.sampler))

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
    with running(proc):
        yield proc


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


# ------------------------------------------------------------------------------------------
# hostile bodies: refused at once, /health answering throughout
# ------------------------------------------------------------------------------------------

HOSTILE_BYTES = 200 * 1024**2


def _upload(server, total: int, chunk: int, pause_s: float, chunked: bool) -> dict:
    """POST a `total`-byte body over a raw socket, `chunk` bytes at a time with `pause_s`
    between, declared by Content-Length or sent chunked, while a thread reads the answer as
    it comes (httpx would read only after sending everything). Times are from the headers."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=120)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    sock.sendall((f"POST {C} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {AUTH['Authorization']}"
                  f"\r\nContent-Type: application/json\r\n{framing}\r\n\r\n").encode())
    start = time.monotonic()
    answer = bytearray()
    first: list[float] = []

    def read() -> None:
        while data := sock.recv(65536):
            first.append(first[0] if first else time.monotonic() - start)
            answer.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    body = (b'{"prompt": "' + b"a" * chunk)[:chunk]
    sent = 0
    try:
        while sent < total:
            piece = body[:min(chunk, total - sent)]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
            time.sleep(pause_s)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server closed the connection before the upload ended
        pass
    upload_s = time.monotonic() - start
    reader.join(60)
    sock.close()
    return {"answer": bytes(answer), "first_s": first[0] if first else None,
            "upload_s": upload_s, "sent": sent}


class _HealthProbe:
    """/health every 20 ms from a thread with its own connection, as a load balancer probes."""

    def __init__(self, server) -> None:
        self._url = f"{server.url}/health"
        self._stop = threading.Event()
        self.ms: list[float] = []
        self.bad = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            http.get(self._url)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                ok = http.get(self._url).status_code == 200
                self.ms.append((time.perf_counter() - t0) * 1000)
                self.bad += not ok
                time.sleep(0.02)

    def __enter__(self) -> "_HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked-slow"])
def test_a_200_mb_body_is_refused_at_once_and_health_stays_fast(server, chunked):
    """A 200 MB body, 1 MiB every 20 ms (a slow client: some 5 s in all), declared by its
    Content-Length or chunked (no Content-Length: counted as it arrives; the limit is 1 MB, so
    the first MiB is past it). The 413 must arrive within 2 s of the request's start, long
    before the upload ends, and /health must keep answering meanwhile.

    /health is held to its median (< 100 ms) and its worst answer (< 500 ms) rather than to
    every answer < 100 ms: this runs on 2 CPU cores shared with other jobs, where the test's
    own threads and the server's process can wait a scheduler slice or two for a core. Before
    the fix the 413 came only after the whole body had been read and dropped (here: after the
    upload's 5 s)."""
    with _HealthProbe(server) as probe:
        time.sleep(0.3)  # idle answers first, so that the probe is connected and warm
        result = _upload(server, HOSTILE_BYTES, 1024**2, 0.02, chunked)
        time.sleep(0.3)
    head = result["answer"].split(b"\r\n\r\n", 1)[0].decode().lower()
    assert head.startswith("http/1.1 413"), result["answer"][:300]
    assert "connection: close" in head
    assert b"--max-request-body-bytes" in result["answer"]
    assert result["first_s"] < 2.0, result
    assert result["upload_s"] > result["first_s"] + 2.0, result  # long before the upload ended
    during = probe.ms
    assert probe.bad == 0 and len(during) >= 10, (probe.bad, len(during))
    median, worst = statistics.median(during), max(during)
    print(f"413 after {result['first_s'] * 1000:.0f} ms, upload {result['upload_s']:.1f} s "
          f"({result['sent'] / 1024**2:.0f} MiB sent); /health over {len(during)} probes: "
          f"median {median:.1f} ms, max {worst:.1f} ms")
    assert median < 100 and worst < 500, (median, worst)
    assert _post(server, C, {"prompt": "still serving", "max_tokens": 2}).status_code == 200
