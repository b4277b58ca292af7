"""`kvserve route --prefill URL --decode URL`: prefill/decode disaggregation at the gateway
(kvserve/router/disagg.py), a real gateway process in front of fake upstream servers on real
sockets that record what they receive: the prefill hop's body (one token, not streamed,
`do_remote_decode`), the decode hop's (the client's body plus the prefill's
`kv_transfer_params`), streams relayed, and every prefill fault ending in the decode
instance's answer (it computes the prompt itself) except a 4xx, which goes to the client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from kvserve.utils.ports import free_port
from test_router import Proc

TRANSFER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
            "remote_port": 14579, "remote_block_ids": [3, 4]}


# ------------------------------------------------------------------------------------------
# fake upstreams: a `kvserve serve` as the gateway sees it, on a real socket
# ------------------------------------------------------------------------------------------

class Upstream:
    """A fake prefill or decode instance: records each POST (path, Authorization, JSON body)
    and answers by `mode`. Prefill modes: ok, 500, 400, no_params, drop (close the connection
    unanswered), hang (answer after 3 s), down (drop, and fail the health checks too). A decode
    instance streams three chunks when asked, the last one only once `release` is set."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.name = role, f"{role}{index}"
        self.mode = "ok"
        self.posts: list[tuple[str, str | None, dict[str, Any]]] = []
        self.release = threading.Event()
        self.release.set()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.upstream = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, _, body in self.posts]

    def reset(self) -> None:
        self.mode = "ok"
        self.posts.clear()
        self.release.set()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a dropped or timed-out connection is what a fault test asks for


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    @property
    def up(self) -> Upstream:
        return self.server.upstream  # type: ignore[attr-defined]

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(503 if self.up.mode == "down" else 200, {})
        elif self.path.startswith("/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": self.up.name}]})
        else:  # /v1/kv_events among them: the gateway then routes by history alone
            self._json(404, {"error": {"message": "not here"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.up.posts.append((self.path, self.headers.get("authorization"), body))
        if not isinstance(body, dict):
            self._json(400, {"error": {"message": "the body must be a JSON object"}})
        elif self.up.role == "prefill":
            self._prefill(body)
        elif body.get("stream"):
            self._stream()
        else:
            self._json(200, {"object": "text_completion", "served_by": self.up.name,
                             "choices": [{"index": 0, "text": f"decoded by {self.up.name}",
                                          "finish_reason": "length"}]})

    def _prefill(self, body: dict[str, Any]) -> None:
        mode = self.up.mode
        if mode in ("drop", "down"):
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if mode == "hang":
            time.sleep(3)
        if mode == "500":
            return self._json(500, {"error": {"message": "engine died", "code": 500}})
        if mode == "400":
            return self._json(400, {"error": {"message": "prompt too long", "code": 400}})
        answer = {"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
        if mode != "no_params":
            answer["kv_transfer_params"] = {**TRANSFER, "remote_engine_id": self.up.name}
        self._json(200, answer)

    def _stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(3):
            if i == 2:
                self.up.release.wait(30)
            event = {"choices": [{"index": 0, "text": f"t{i}"}], "served_by": self.up.name}
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


# ------------------------------------------------------------------------------------------
# the gateway process over two prefill and two decode fakes
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    prefill = [Upstream("prefill", i) for i in range(2)]
    decode = [Upstream("decode", i) for i in range(2)]
    argv = ["route", "--health-interval", "0.2", "--prefill-timeout", "1"]
    for u in prefill:
        argv += ["--prefill", u.url]
    for u in decode:
        argv += ["--decode", u.url]
    gw = Proc("pd-gateway", argv, free_port(), tmp_path_factory.mktemp("pd-logs"))
    try:
        gw.wait_ready(timeout=60)
        yield {"gateway": gw, "prefill": prefill, "decode": decode}
    finally:
        gw.stop()
        for u in prefill + decode:
            u.close()


@pytest.fixture
def cluster(pd):
    """The module's gateway with every fake answering normally, nothing recorded, all four
    instances back in the gateway's rotation (a fault test may have taken one out)."""
    for u in pd["prefill"] + pd["decode"]:
        u.reset()
    deadline = time.monotonic() + 10
    while httpx.get(pd["gateway"].url + "/health").json()["healthy_replicas"] != 4:
        assert time.monotonic() < deadline, "an instance was not re-admitted"
        time.sleep(0.1)
    return pd


def _posts(ups: list[Upstream]) -> list[tuple[str, str | None, dict[str, Any]]]:
    return [p for u in ups for p in u.posts]


def _prefills(gw: Proc) -> dict[str, float]:
    out = {}
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith("kvserve:router_pd_prefills_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_prefill_gets_one_token_and_the_decode_gets_the_body_plus_its_transfer(cluster):
    gw = cluster["gateway"]
    body = {"model": "m", "prompt": list(range(5, 60)), "max_tokens": 40, "temperature": 0.5,
            "min_tokens": 3, "n": 2, "stop": ["\n"]}
    r = httpx.post(gw.url + "/v1/completions", json=body,
                   headers={"authorization": "Bearer client-key"})
    assert r.status_code == 200, r.text
    decoder = r.headers["x-kvserve-replica"]
    assert r.json()["served_by"] == decoder and decoder.startswith("decode")
    [(path, auth, sent)] = _posts(cluster["prefill"])
    assert path == "/v1/completions" and auth == "Bearer client-key"
    assert sent == {**{k: v for k, v in body.items() if k != "min_tokens"}, "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    prefiller = r.headers["x-kvserve-prefill"]
    [(path, auth, got)] = _posts(cluster["decode"])
    assert path == "/v1/completions" and auth == "Bearer client-key"
    assert got == {**body, "kv_transfer_params": {**TRANSFER, "remote_engine_id": prefiller}}
    assert _prefills(gw)["ok"] >= 1


def test_chat_drops_the_streaming_and_length_fields_on_the_prefill_hop_and_streams_decode(
        cluster):
    gw = cluster["gateway"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2"]
    assert events[-1] == "[DONE]"
    [(path, _, sent)] = _posts(cluster["prefill"])
    assert path == "/v1/chat/completions"
    assert sent == {"model": "m", "messages": body["messages"], "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    [(_, _, got)] = _posts(cluster["decode"])
    assert got == {**body, "kv_transfer_params": {**TRANSFER,
                                                  "remote_engine_id": r.headers[
                                                      "x-kvserve-prefill"]}}


def test_a_stream_is_relayed_as_it_comes_and_decode_goes_to_the_least_loaded(cluster):
    """The first stream holds its last chunk: its first two reach the client meanwhile, and
    the next request goes to the other decode instance (the busy one has a request in
    flight)."""
    gw = cluster["gateway"]
    for u in cluster["decode"]:
        u.release.clear()
    body = {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", gw.url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()
            seen = [next(lines) for _ in range(4)]  # two events, each with its blank line
            assert [json.loads(x[6:])["choices"][0]["text"] for x in seen if x] == ["t0", "t1"]
            busy = first.headers["x-kvserve-replica"]
            r = http.post(gw.url + "/v1/completions", json={"prompt": [1, 2, 3]})
            assert r.status_code == 200 and r.headers["x-kvserve-replica"] != busy
            for u in cluster["decode"]:
                u.release.set()
            rest = [x[6:] for x in lines if x.startswith("data: ")]
    assert json.loads(rest[0])["choices"][0]["text"] == "t2" and rest[-1] == "[DONE]"


def test_the_prefill_pool_is_chosen_cache_aware(cluster):
    gw = cluster["gateway"]
    prefix = list(range(1000, 1064))  # four blocks of 16 tokens
    served = []
    for tail in ([1, 2], [3, 4], [5, 6]):
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": prefix + tail})
        assert r.status_code == 200
        served.append(r.headers["x-kvserve-prefill"])
    assert len(set(served)) == 1, served
    state = httpx.get(gw.url + "/replicas").json()["replicas"]
    assert {s["role"] for s in state} == {"prefill", "decode"}
    assert all(s["known_blocks"] == 0 for s in state if s["role"] == "decode")


@pytest.mark.parametrize("mode", ["drop", "500", "no_params", "hang"])
def test_a_failed_prefill_falls_back_to_decoding_the_whole_prompt(cluster, mode):
    gw = cluster["gateway"]
    for u in cluster["prefill"]:
        u.mode = mode
    before = _prefills(gw).get("failed", 0)
    body = {"prompt": "tell me a story", "max_tokens": 7}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("decoded by decode")
    assert "x-kvserve-prefill" not in r.headers
    assert [b for _, _, b in _posts(cluster["decode"])] == [body]  # no kv_transfer_params
    assert _posts(cluster["prefill"])  # it was tried
    assert _prefills(gw)["failed"] == before + 1


def test_with_every_prefill_instance_dead_decode_answers_alone(cluster):
    gw = cluster["gateway"]
    for u in cluster["prefill"]:
        u.mode = "down"
    deadline = time.monotonic() + 10
    while httpx.get(gw.url + "/health").json()["prefill"]["healthy"]:
        assert time.monotonic() < deadline, "the dead prefill instances stayed in"
        time.sleep(0.1)
    before = _prefills(gw).get("failed", 0)
    body = {"messages": [{"role": "user", "content": "b"}], "stream": True}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body)
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) == 4
    assert not _posts(cluster["prefill"])  # none was available to try
    assert [b for _, _, b in _posts(cluster["decode"])] == [body]
    assert _prefills(gw)["failed"] == before + 1
    assert httpx.get(gw.url + "/health").status_code == 200


def test_a_prefill_4xx_goes_back_to_the_client_and_decode_is_not_tried(cluster):
    gw = cluster["gateway"]
    for u in cluster["prefill"]:
        u.mode = "400"
    before = _prefills(gw).get("rejected", 0)
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    assert r.headers["x-kvserve-replica"].startswith("prefill")
    assert not _posts(cluster["decode"])
    assert _prefills(gw)["rejected"] == before + 1


def test_a_body_that_is_not_json_goes_to_decode_alone(cluster):
    r = httpx.post(cluster["gateway"].url + "/v1/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    assert r.headers["x-kvserve-replica"].startswith("decode")
    assert not _posts(cluster["prefill"]) and len(_posts(cluster["decode"])) == 1


def test_models_come_from_a_decode_instance_and_health_counts_both_pools(cluster):
    gw = cluster["gateway"]
    models = httpx.get(gw.url + "/v1/models").json()
    assert models["data"][0]["id"].startswith("decode")
    assert httpx.get(gw.url + "/v1/models/m").json()["data"][0]["id"].startswith("decode")
    health = httpx.get(gw.url + "/health").json()
    assert health == {"healthy_replicas": 4, "replicas": 4,
                      "prefill": {"healthy": 2, "replicas": 2},
                      "decode": {"healthy": 2, "replicas": 2}}
    text = httpx.get(gw.url + "/metrics").text
    assert 'kvserve:router_replica_healthy{replica="prefill1"} 1.0' in text
    assert 'kvserve:router_replica_healthy{replica="decode0"} 1.0' in text


def test_without_a_decode_instance_the_gateway_answers_503_and_skips_the_prefill():
    """In-process (test_router.py's fake transport): decode instances failing their health
    checks make /health a 503 and a request a 503, with no prefill spent on it."""
    from kvserve.router.app import RouterConfig, build_router_app
    from kvserve.router.disagg import DisaggGateway, disagg_pools
    from kvserve.router.keys import PrefixKeyer
    from kvserve.router.policies import make_policy
    from test_router import _call

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200 if request.url.host.startswith("p") else 503)
        seen.append(request.url.host)
        return httpx.Response(200, json={"kv_transfer_params": {}})

    prefill, decode = disagg_pools(["http://p0"], ["http://d0", "http://d1"], 16)
    gw = DisaggGateway(prefill, decode, make_policy("cache_aware", 1, 16), PrefixKeyer(16),
                       RouterConfig(health_interval_s=60, kv_events=False),
                       transport=httpx.MockTransport(handler))
    app = build_router_app(gw)
    r = asyncio.run(_call(app, "GET", "/health"))
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": [1, 2]}))
    assert r.status_code == 503 and not seen
    assert "kvserve:router_unroutable_total 1.0" in gw.metrics.render().decode()


# ------------------------------------------------------------------------------------------
# flags
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--prefill", "http://a"], "--prefill needs --decode"),
    (["--decode", "http://a"], "--decode needs --prefill"),
    (["--replica", "http://a", "--prefill", "http://b", "--decode", "http://c"],
     "--replica cannot be combined"),
    ([], "give --replica URL"),
    (["--prefill", "http://a", "--decode", "http://b", "--prefill-timeout", "0"],
     "--prefill-timeout must be > 0"),
])
def test_flag_errors_say_what_to_give(argv, message):
    from kvserve.entrypoints.cli import route_parser
    from kvserve.router.launch import build_gateway

    with pytest.raises(ValueError, match=message):
        build_gateway(route_parser().parse_args(argv))


def test_the_flags_build_a_disaggregated_gateway_and_the_cli_reports_errors():
    from kvserve.entrypoints.cli import route_parser
    from kvserve.router.disagg import DisaggGateway
    from kvserve.router.launch import build_gateway

    gw = build_gateway(route_parser().parse_args([
        "--prefill", "http://p:1", "--prefill", "http://p:2", "--decode", "http://d:1",
        "--policy", "consistent_hash", "--prefill-timeout", "5"]))
    assert isinstance(gw, DisaggGateway) and gw.policy.name == "consistent_hash"
    assert [r.name for r in gw.replicas] == ["prefill0", "prefill1"]
    assert [r.name for r in gw.decode.replicas] == ["decode0"]
    assert gw.decode.policy.name == "least_loaded" and gw.config.prefill_timeout_s == 5
    assert type(build_gateway(route_parser().parse_args(["--replica", "http://r"]))
                ).__name__ == "Gateway"
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "route", "--prefill",
                          "http://p:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--prefill needs --decode" in out.stderr
