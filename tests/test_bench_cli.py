"""`kvserve bench latency | throughput | serve | prefix` (kvserve/bench/).

`bench serve` runs against a real `kvserve serve` process on the tiny random-weight model, and
against a small OpenAI-compatible server written here (FastAPI, chunks built from the official
`openai` package's types) that streams with known delays: the TTFT and inter-token latencies
the benchmark records must be those delays, and every percentile it reports must equal numpy's
percentile of the per-request timings it recorded."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletionChunk

from kvserve.bench import datasets
from kvserve.bench.serve import arrival_gaps
from kvserve.bench.stats import percentile
from kvserve.entrypoints.cli import main
from kvserve.utils.ports import free_port
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

FIRST_DELAY = 0.15  # seconds before the fake server's first output chunk, plus STEP x request
STEP = 0.02
GAP = 0.04  # seconds between its output chunks
CHUNKS = 4


# ------------------------------------------------------------------------------------------
# a fake OpenAI-compatible server with known delays
# ------------------------------------------------------------------------------------------
class FakeServer:
    """Request k (in arrival order) waits FIRST_DELAY + STEP * k before its first chunk, then
    GAP between chunks; chat streams send a role-only chunk at once (it is no output)."""

    def __init__(self) -> None:
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.delays: list[float] = []
        app = FastAPI()
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def _begin(self) -> float:
        delay = FIRST_DELAY + STEP * self.count
        self.count += 1
        self.delays.append(delay)
        return delay

    def _usage(self) -> CompletionUsage:
        return CompletionUsage(prompt_tokens=10, completion_tokens=CHUNKS, total_tokens=10 + CHUNKS)

    async def _stream(self, delay: float, chunk, usage_chunk):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(delay)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP)
                yield f"data: {chunk(i).model_dump_json(exclude_none=True)}\n\n"
            yield f"data: {usage_chunk.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    async def completions(self, request: Request):
        await request.json()
        delay = self._begin()

        def chunk(i):
            return Completion(id="c", object="text_completion", created=0, model="fake",
                              choices=[CompletionChoice(index=0, text=f" w{i}",
                                                        finish_reason="length")])
        usage = Completion(id="c", object="text_completion", created=0, model="fake",
                           choices=[], usage=self._usage())
        return StreamingResponse(self._stream(delay, chunk, usage),
                                 media_type="text/event-stream")

    async def chat(self, request: Request):
        await request.json()
        delay = self._begin()

        def make(delta: dict, usage=None):
            choices = [{"index": 0, "delta": delta, "finish_reason": None}] if delta else []
            return ChatCompletionChunk.model_validate(
                {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                 "choices": choices, "usage": usage})

        async def stream():
            yield f"data: {make({'role': 'assistant', 'content': ''}).model_dump_json()}\n\n"
            async for part in self._stream(delay, lambda i: make({"content": f" w{i}"}),
                                           make({}, self._usage().model_dump())):
                yield part

        return StreamingResponse(stream(), media_type="text/event-stream")


def _run_bench(argv: list[str], tmp_path: Path, name: str = "out.json") -> dict:
    path = tmp_path / name
    assert main(["bench", *argv, "--disable-tqdm", "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


def _check_percentiles(out: dict, metrics=("ttft", "tpot", "itl", "e2el"),
                       qs=(50, 90, 99)) -> None:
    """Every reported figure equals numpy's, computed here from the recorded timings."""
    ok = [i for i, e in enumerate(out["errors"]) if not e]
    values = {"ttft": [out["ttfts"][i] * 1e3 for i in ok],
              "itl": [x * 1e3 for i in ok for x in out["itls"][i]],
              "e2el": [out["e2els"][i] * 1e3 for i in ok],
              "tpot": [(out["e2els"][i] - out["ttfts"][i]) / (out["output_lens"][i] - 1) * 1e3
                       for i in ok if out["output_lens"][i] > 1]}
    for m in metrics:
        v = np.array(values[m])
        assert out[f"mean_{m}_ms"] == pytest.approx(v.mean(), rel=1e-9)
        assert out[f"median_{m}_ms"] == pytest.approx(np.median(v), rel=1e-9)
        assert out[f"std_{m}_ms"] == pytest.approx(v.std(), rel=1e-9, abs=1e-9)
        for q in qs:
            assert out[f"p{q}_{m}_ms"] == pytest.approx(np.percentile(v, q), rel=1e-9)
    assert out["completed"] == len(ok)
    assert out["total_output_tokens"] == sum(out["output_lens"][i] for i in ok)
    assert out["output_throughput"] == pytest.approx(out["total_output_tokens"]
                                                     / out["duration"])


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_serve_measures_a_fake_servers_known_delays(backend, tmp_path):
    n = 8
    with FakeServer() as fake:
        out = _run_bench(["serve", "--base-url", fake.url, "--backend", backend,
                          "--prompt-format", "text", "--num-prompts", str(n),
                          "--num-warmups", "0", "--max-concurrency", "1"], tmp_path)
    # one at a time: request k's TTFT is its delay, plus client/loopback overhead only
    ttfts = out["ttfts"]
    assert len(ttfts) == n and not any(out["errors"])
    for got, delay in zip(ttfts, fake.delays):
        assert delay <= got < delay + 0.05
    for gaps in out["itls"]:
        assert len(gaps) == CHUNKS - 1
        assert all(GAP * 0.9 <= g < GAP + 0.05 for g in gaps)
    assert out["output_lens"] == [CHUNKS] * n and out["input_lens"] == [10] * n
    assert fake.max_in_flight == 1
    _check_percentiles(out)
    # and the percentiles sit where the known delays put them
    assert out["p50_ttft_ms"] == pytest.approx(1e3 * np.percentile(fake.delays, 50), abs=50)
    assert out["p90_ttft_ms"] == pytest.approx(1e3 * np.percentile(fake.delays, 90), abs=50)


def test_serve_keeps_to_max_concurrency_and_custom_percentiles(tmp_path):
    with FakeServer() as fake:
        out = _run_bench(["serve", "--base-url", fake.url, "--num-prompts", "12",
                          "--num-warmups", "0", "--max-concurrency", "3",
                          "--metric-percentiles", "25,75,99.9",
                          "--percentile-metrics", "ttft,e2el"], tmp_path)
    assert fake.max_in_flight == 3
    assert "p99.9_ttft_ms" in out and "mean_itl_ms" not in out
    _check_percentiles(out, metrics=("ttft", "e2el"), qs=(25, 75, 99.9))


def test_arrivals_and_datasets():
    gaps = arrival_gaps(20000, rate=10.0, burstiness=1.0, seed=0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.1, rel=0.05)  # exponential: std = mean
    bursty = arrival_gaps(20000, rate=10.0, burstiness=0.25, seed=0)
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.07) and np.std(bursty) > 0.18
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0] * 3
    src = datasets.TokenSource(__import__("random").Random(0), "token-ids", 10, 50)
    reqs = datasets.prefix_repetition_requests(6, 16, 4, 2, 8, src)
    assert [len(r.prompt) for r in reqs] == [20] * 6
    assert reqs[0].prompt[:16] == reqs[2].prompt[:16] != reqs[1].prompt[:16]
    assert all(10 <= t < 50 for r in reqs for t in r.prompt)
    rnd = datasets.random_requests(50, 32, 8, src, range_ratio=0.5, prefix_len=5)
    assert all(5 + 16 <= len(r.prompt) == r.prompt_len <= 5 + 48 for r in rnd)
    convs = datasets.multi_turn_conversations(3, 2, 20, 5, 4, seed=1)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system.split()) == 20
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(np.percentile([1, 2, 3, 4], 90))


def test_sse_lines_split_where_the_spec_splits_and_nowhere_else():
    """Another server may send U+2028 and friends raw inside an event's JSON (llama-server
    does); the client must not cut the event there, and must join a CRLF split across reads."""
    from kvserve.bench.client import sse_lines

    events = ['data: {"t":"a\u2028b\x85c\u2029"}', "data: [DONE]"]
    wire = ("\r\n\r\n".join(events) + "\n\n").encode()
    reads = [wire[:12], wire[12:wire.index(b"\r") + 1], wire[wire.index(b"\r") + 1:]]
    transport = httpx.MockTransport(lambda req: httpx.Response(200, stream=_Reads(reads)))

    async def lines():
        async with httpx.AsyncClient(transport=transport) as http:
            async with http.stream("GET", "http://x/") as r:
                return [line async for line in sse_lines(r)]

    got = asyncio.run(lines())
    assert [x for x in got if x] == events
    assert json.loads(got[0][len("data: "):])["t"] == "a\u2028b\x85c\u2029"


class _Reads(httpx.AsyncByteStream):
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def __aiter__(self):
        for b in self.reads:
            yield b


# ------------------------------------------------------------------------------------------
# against a real `kvserve serve`
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kvserve_server(tmp_path_factory):
    from kvserve.model_loader.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("bench-model") / "tiny", arch="qwen2",
                       size="tiny")
    srv = ServerProcess("bench", [str(model), "--kv-cache-memory-bytes", str(32 << 20)],
                        tmp_path_factory.mktemp("bench-logs"), max_model_len=1024)
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() is None, srv.log()[-3000:]


@pytest.mark.parametrize("fmt", ["token-ids", "text"])
def test_serve_against_kvserve_shared_prefix(kvserve_server, fmt, tmp_path):
    out = _run_bench(["serve", "--base-url", kvserve_server.url, "--dataset-name",
                      "prefix_repetition", "--prompt-format", fmt, "--num-prompts", "12",
                      "--prefix-repetition-prefix-len", "96", "--prefix-repetition-suffix-len",
                      "8", "--prefix-repetition-output-len", "6", "--request-rate", "40"],
                     tmp_path)
    assert out["completed"] == 12 and out["failed"] == 0
    assert out["output_lens"] == [6] * 12  # ignore_eos: the full length
    if fmt == "token-ids":
        assert out["input_lens"] == [104] * 12  # exact lengths
    assert sum(out["cached_tokens"]) > 0 and 0 < out["prefix_cache_hit_rate"] <= 1
    _check_percentiles(out)


def test_serve_multi_turn_against_kvserve(kvserve_server, tmp_path):
    out = _run_bench(["serve", "--base-url", kvserve_server.url, "--dataset-name", "multi_turn",
                      "--num-prompts", "3", "--multi-turn-turns", "3", "--multi-turn-system-len",
                      "60", "--multi-turn-user-len", "8", "--multi-turn-output-len", "5",
                      "--save-result", "--result-dir", str(tmp_path / "res"),
                      "--plot", str(tmp_path / "serve.png")], tmp_path)
    assert out["backend"] == "openai-chat" and out["completed"] == 9
    # later turns resend the conversation: longer prompts, served from the cache
    assert max(out["input_lens"]) > min(out["input_lens"]) and sum(out["cached_tokens"]) > 0
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    _check_percentiles(out)


def _kvserve_processes(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "kvserve.entrypoints.cli serve" in cmd and marker in cmd:
                pids.append(int(d.name))
    return pids


def test_serve_starts_and_stops_its_own_kvserve(tiny_model_dir, tmp_path):
    out = _run_bench(["serve", "--server-model", str(tiny_model_dir), "--server-args",
                      "--max-model-len 256 --num-threads 2 --kv-cache-memory-bytes 16000000",
                      "--num-prompts", "6", "--random-input-len", "16", "--random-output-len",
                      "4"], tmp_path)
    assert out["completed"] == 6 and out["input_lens"] == [16] * 6
    assert _kvserve_processes(str(tiny_model_dir)) == []  # no orphan


# ------------------------------------------------------------------------------------------
# the offline benchmarks
# ------------------------------------------------------------------------------------------
ENGINE = ["--kv-cache-memory-bytes", str(16 << 20), "--num-threads", "2"]


def test_latency(tiny_model_dir, tmp_path):
    out = _run_bench(["latency", str(tiny_model_dir), *ENGINE, "--input-len", "16",
                      "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1",
                      "--num-iters", "5", "--plot", str(tmp_path / "lat.png")], tmp_path)
    assert len(out["latencies"]) == 5
    assert out["avg_latency"] == pytest.approx(np.mean(out["latencies"]))
    assert out["percentiles"]["90"] == pytest.approx(np.percentile(out["latencies"], 90))
    assert (tmp_path / "lat.png").read_bytes()[:4] == b"\x89PNG"


def test_throughput(tiny_model_dir, tmp_path):
    out = _run_bench(["throughput", str(tiny_model_dir), *ENGINE, "--num-prompts", "6",
                      "--input-len", "12", "--output-len", "5", "--prefix-len", "32"], tmp_path)
    assert out["total_output_tokens"] == 30 and out["full_length"]
    assert out["total_num_tokens"] == 6 * 44 + 30
    assert out["output_throughput"] == pytest.approx(30 / out["elapsed_time"])
    assert out["cached_tokens"] > 0  # the common prefix, computed once


@pytest.mark.parametrize("method", ["reset", "off"])
def test_prefix_cold_vs_cached(tiny_model_dir, tmp_path, method):
    out = _run_bench(["prefix", str(tiny_model_dir), *ENGINE, "--prefix-lens", "64,128",
                      "--suffix-len", "8", "--num-samples", "2", "--cold-method", method,
                      "--plot", str(tmp_path / "p.png")], tmp_path)
    for row in out["rows"]:
        assert row["cold_cached_tokens"] == [0]
        assert row["cached_cached_tokens"] == [row["prefix_len"]]  # whole blocks of 16
        assert row["same_first_token"]
        cold = [s["ttft_s"] for s in row["samples"]["cold"]]
        assert row["cold"]["median"] == pytest.approx(np.median(cold))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_help_lists_vllm_flags(capsys):
    for sub, flags in (("serve", ["--request-rate", "--burstiness", "--max-concurrency",
                                  "--percentile-metrics", "--metric-percentiles",
                                  "--save-result", "--result-dir", "--dataset-name"]),
                       ("latency", ["--input-len", "--num-iters-warmup", "--batch-size",
                                    "--dtype"]),
                       ("throughput", ["--num-prompts", "--output-len", "--num-threads"])):
        with pytest.raises(SystemExit):
            main(["bench", sub, "--help"])
        text = capsys.readouterr().out
        assert all(f in text for f in flags), sub


def test_throughput_structured_fraction(tiny_model_dir, tmp_path):
    """--structured-regex holds the constrained share of the batch to the regex, as Python's
    own `re` reads the texts (decoded by the tokenizers library, not kvserve)."""
    import re

    from tokenizers import Tokenizer

    out = _run_bench(["throughput", str(tiny_model_dir), *ENGINE, "--num-prompts", "4",
                      "--input-len", "8", "--output-len", "12",
                      "--structured-regex", "[a-z ]{400}", "--structured-fraction", "0.5"],
                     tmp_path)
    assert out["total_output_tokens"] == 48 and out["full_length"]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    texts = [tok.decode(ids) for ids in out["first_outputs"]]
    assert all(re.fullmatch("[a-z ]+", t) for t in texts[:2]), texts
    assert not all(re.fullmatch("[a-z ]*", t) for t in texts[2:]), texts  # the free half
