"""Issue 63, items 1 and 2, as an attacker with an ordinary API key meets them: real `kvserve
serve` processes (the units: tests/test_transfer_trust.py).

1. A KV consumer connects only where its operator said. `kv_transfer_params` pointing at a
   listener of ours (by address, by a name that resolves to it, by an unknown engine id, with an
   ordinary key and with the admin's) is a 400, and the listener never sees a connection.
2. Nothing a caller plants is served. A fake producer, configured (the operator trusted its
   address), answers every pull with well-framed zeros whose checksum is right but whose MAC is
   not: the attacker's request still answers right (recomputed), another key's request for the
   same prompt (`--kv-isolation none`: the caches are shared) answers what a clean server
   answers, and the failure is counted. The same for a disk chunk and a Redis value rewritten
   with a matching checksum: a counted miss, and the clean answer.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
import time

import httpx
import pytest
import torch
from chunk_forgery import foreign_chunk, rewrite_payload
from server_process import ServerProcess, running
from test_router import replica_model

from kvserve.kv.tiers.peer import _LEN

KEY_A, KEY_B, ADMIN = "attacker-key", "victim-key", "admin-key"
BLOCK = 16  # kvserve serve's default block size: the transfer's chunk size
AUTH_ENV = {"KVSERVE_KV_AUTH_KEY": "hostile-transfer-test-key-0123456789"}
WORDS = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "token", "decode", "ring"]


def _prompt(seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(70))


def _chunk_layout() -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the served model's KV chunks (what a forger can learn from the
    public config): [layers, K/V, chunk tokens, KV heads, head dim], float32."""
    with open(os.path.join(replica_model(), "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"], 2, BLOCK, cfg["num_key_value_heads"], head_dim), \
        torch.float32


class Listener:
    """A TCP listener on 127.0.0.1 that records every connection it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[tuple[str, int]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.accepted.append(peer)
            conn.close()

    def close(self) -> None:
        self.sock.close()


class FakeProducer(socketserver.ThreadingTCPServer):
    """Speaks kvserve's peer protocol (kv/tiers/peer.py) and answers every key with zeros in
    kvserve's framing, checksum right, MAC made with a key of its own."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        shape, dtype = _chunk_layout()
        self.asked: list[str] = []
        fake = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while (line := self.rfile.readline(2048)).startswith(b"GET "):
                    key = line[4:].strip().decode()
                    fake.asked.append(key)
                    blob = foreign_chunk(key, shape, dtype)
                    self.wfile.write(_LEN.pack(len(blob)) + blob)
                    self.wfile.flush()

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _serve(name: str, log_dir, *extra: str) -> ServerProcess:
    return ServerProcess(name, [replica_model(), "--served-model-name", "default",
                                "--num-threads", "1", "--api-key", KEY_A, "--api-key", KEY_B,
                                "--admin-api-key", ADMIN, *extra], log_dir, env=AUTH_ENV)


@pytest.fixture(scope="module")
def listener():
    sock = Listener()
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def fake_producer():
    server = FakeProducer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def redis_url():
    from redis_server import start_redis

    server = start_redis()
    yield server.url
    server.close()


@pytest.fixture(scope="module")
def consumer(tmp_path_factory, fake_producer):
    cfg = {"kv_connector": "kvserve", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"producers": [f"127.0.0.1:{fake_producer.port}"]}}
    proc = _serve("consumer", tmp_path_factory.mktemp("hostile-consumer"),
                  "--kv-transfer-config", json.dumps(cfg), "--kv-isolation", "none")
    with running(proc):
        yield proc


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, redis_url):
    """A server with a disk and a Redis tier and no host tier, saving each chunk as it is
    computed: what it reads back comes from disk or Redis. Also the clean reference."""
    disk = tmp_path_factory.mktemp("hostile-disk")
    cfg = {"chunk_size": BLOCK, "local_cpu": False, "local_disk": str(disk),
           "max_local_disk_size": 0.01, "remote_url": redis_url, "write_policy": "write_through"}
    proc = _serve("tiered", tmp_path_factory.mktemp("hostile-tiered"),
                  "--kv-tier-config", json.dumps(cfg))
    with running(proc):
        yield proc, disk


def _complete(url: str, key: str, prompt: str, transfer: dict | None = None) -> httpx.Response:
    body = {"model": "default", "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    return httpx.post(url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def _answer(url: str, key: str, prompt: str, transfer: dict | None = None) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion that must succeed."""
    r = _complete(url, key, prompt, transfer)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return r.json()["choices"][0]["text"], \
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _tier_errors(url: str, tier: str, kind: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("kvserve:kv_tier_errors_total{")
               and f'tier="{tier}"' in line and f'kind="{kind}"' in line)


def _pull(host: str, port: int, **more) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": host,
            "remote_port": port, "kv_connector": "kvserve", **more}


# -- 1. the server connects only where its operator said ----------------------------------------
@pytest.mark.parametrize("key", [KEY_A, ADMIN])
def test_a_caller_cannot_make_the_consumer_connect_anywhere(consumer, listener, key):
    asks = [_pull("127.0.0.1", listener.port), _pull("localhost", listener.port),
            _pull("127.0.0.1", listener.port, remote_engine_id="not-configured"),
            {"do_remote_prefill": True, "remote_engine_id": "not-configured"}]
    for transfer in asks:
        r = _complete(consumer.url, key, _prompt(1), transfer)
        assert r.status_code == 400, (transfer, r.text)
        assert "no producer this KV consumer is configured" in r.json()["error"]["message"]
    time.sleep(0.5)  # a connection attempt, had there been one, has reached the listener
    assert listener.accepted == []


# -- 2. nothing a fake producer or a planted chunk holds is served -------------------------------
def test_a_fake_producers_chunks_are_never_served(consumer, fake_producer, tiered):
    clean, _ = tiered
    prompt = _prompt(2)
    want, _ = _answer(clean.url, KEY_A, prompt)
    before = _tier_errors(consumer.url, "peer", "auth_failed")
    got, cached = _answer(consumer.url, KEY_A, prompt, _pull("127.0.0.1", fake_producer.port))
    assert fake_producer.asked, "the consumer never pulled: the test tested nothing"
    assert (got, cached) == (want, 0)
    # Another tenant, no transfer, the caches shared: what it reuses is what was recomputed.
    assert _answer(consumer.url, KEY_B, prompt)[0] == want
    assert _tier_errors(consumer.url, "peer", "auth_failed") > before


def _wait_for(count, at_least: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while count() < at_least:
        assert time.monotonic() < deadline, "the chunks were never saved"
        time.sleep(0.1)


def test_tampered_disk_and_redis_chunks_are_counted_misses(tiered, redis_url):
    import redis

    proc, disk = tiered
    prompt = _prompt(3)
    want, _ = _answer(proc.url, KEY_A, prompt)
    client = redis.Redis.from_url(redis_url)
    _wait_for(lambda: len(list(disk.glob("*.kvchunk"))), 2)
    _wait_for(lambda: len(client.keys("kvserve:*")), 2)
    time.sleep(0.5)  # the saver's last writes
    for f in disk.glob("*.kvchunk"):
        f.write_bytes(rewrite_payload(f.read_bytes()))
    for key in client.keys("kvserve:*"):
        client.set(key, rewrite_payload(client.get(key)))
    r = httpx.post(proc.url + "/reset_prefix_cache", timeout=30,
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    before = {t: _tier_errors(proc.url, t, "auth_failed") for t in ("disk", "remote")}
    # Another key asks: nothing is cached any more, and nothing planted is trusted.
    assert _answer(proc.url, KEY_B, prompt) == (want, 0)
    for tier in ("disk", "remote"):
        assert _tier_errors(proc.url, tier, "auth_failed") > before[tier], tier
