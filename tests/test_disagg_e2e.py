"""Prefill/decode disaggregation end to end, as a user deploys it: a producer (`kvserve serve
--kv-transfer-config '{"kv_connector": "kvserve", "kv_role": "kv_producer", ...}'`), a consumer
(`kv_consumer`) and the gateway (`kvserve route --prefill URL --decode URL`), three processes,
against one colocated instance (the reference: tests/test_server.py holds the server to
transformers). Greedy outputs equal the colocated instance's on 64 requests, streaming and not,
with and without prefix hits on either side; usage is the colocated instance's, and the
consumer reports the transferred tokens as cached. Killing the producer: the consumer
recomputes, every answer is still right and the gateway says what happened."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from kvserve.utils.ports import free_port
from test_router import Proc, replica_model

MAX_MODEL_LEN = 512
BLOCK = 16  # kvserve serve's default block size (and so the transfer's chunk size)
N_REQUESTS = 64


def _serve(name: str, log_dir, *extra: str) -> Proc:
    return Proc(name, ["serve", replica_model(), "--served-model-name", "default",
                       "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1",
                       "--disable-log-stats", *extra], free_port(), log_dir)


def _transfer(role: str, port: int = 0, producers: tuple[str, ...] = ()) -> list[str]:
    """The flag for this role; a consumer pulls only from the `producers` it is given."""
    cfg = {"kv_connector": "kvserve", "kv_role": role, "kv_port": port}
    if producers:
        cfg["kv_connector_extra_config"] = {"producers": list(producers)}
    return ["--kv-transfer-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("disagg-logs")
    kv_port = free_port()
    procs = {"colocated": _serve("colocated", log_dir),
             "producer": _serve("producer", log_dir, *_transfer("kv_producer", kv_port)),
             "consumer": _serve("consumer", log_dir,
                                *_transfer("kv_consumer", producers=(f"127.0.0.1:{kv_port}",)))}
    try:
        for p in procs.values():
            p.wait_ready()
        procs["gateway"] = Proc("gateway", ["route", "--health-interval", "0.3",
                                            "--prefill", procs["producer"].url,
                                            "--decode", procs["consumer"].url,
                                            "--tokenizer", replica_model()],
                                free_port(), log_dir)
        procs["gateway"].wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _bodies(n: int, seed: int) -> list[dict]:
    """Completions and chats; a third share a long system prefix (prefix hits on both sides:
    the producer's own cache, and the consumer's device cache for what it pulled before)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "token", "decode"]
    shared = " ".join(rng.choice(words) for _ in range(60))
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))
        if i % 3 == 0:
            text = shared + " " + text
        body = {"model": "default", "max_tokens": rng.randint(4, 16), "temperature": 0.0,
                "stream": i % 2 == 1}
        if i % 4 < 2:
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


def _call(url: str, body: dict) -> tuple[str, dict]:
    """(generated text, usage) of one completion or chat, streamed or not."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        c = j["choices"][0]
        return (c["message"]["content"] if "messages" in body else c["text"]), j["usage"]
    text, usage = [], None
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "" if "messages" in body
                            else c.get("text", ""))
            usage = chunk.get("usage") or usage
    return "".join(text), usage


def test_disaggregated_answers_equal_colocated_ones(deployment):
    colocated, gateway = deployment["colocated"].url, deployment["gateway"].url
    bodies = _bodies(N_REQUESTS, seed=0)
    for body in bodies:
        want_text, want_usage = _call(colocated, body)
        got_text, got_usage = _call(gateway, body)
        assert got_text == want_text, body
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got_usage[k] == want_usage[k], (k, body)
        # The consumer computed only the prompt's last partial block: every whole block of
        # the prompt but its last token's came from the producer (or its own cache), and is
        # reported as cached.
        cached = (got_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached == (got_usage["prompt_tokens"] - 1) // BLOCK * BLOCK, (got_usage, body)
    metrics = httpx.get(deployment["consumer"].url + "/metrics").text
    peer = [line for line in metrics.splitlines()
            if line.startswith("kvserve:prefix_cache_hits_by_source") and 'source="peer"' in line]
    assert peer and float(peer[0].split()[-1]) > 0, peer


def test_a_dead_producer_means_the_consumer_recomputes(deployment):
    colocated, gateway = deployment["colocated"].url, deployment["gateway"].url
    bodies = _bodies(6, seed=1)
    want = [_call(colocated, b)[0] for b in bodies]
    deployment["producer"].kill()
    got = [_call(gateway, b)[0] for b in bodies]
    assert got == want
    metrics = httpx.get(gateway + "/metrics").text
    assert 'outcome="failed"' in metrics
