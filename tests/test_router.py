"""`kvserve route`: the policies as the gateway drives them, its prefix picture and keys, the KV
events, and the gateway as a real process in front of real `kvserve serve` processes (the
embedded default model), driven with the official `openai` client: streaming, n, errors passed
through with their status codes, prefix affinity, KV events matching the gateway's keys, and a
replica killed mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.kv.events import KVEventLog
from kvserve.kv.hashing import chain_hashes, extra_keys
from kvserve.utils.ports import free_port
from kvserve.router.keys import PrefixKeyer
from kvserve.router.policies import (CacheAwarePolicy, ConsistentHashPolicy, LeastLoadedPolicy,
                                     NoReplicaAvailable, RoundRobinPolicy)
from kvserve.router.prefix_view import PrefixView

MAX_MODEL_LEN = 512


# ------------------------------------------------------------------------------------------
# policies, prefix picture, keys, event log (no processes)
# ------------------------------------------------------------------------------------------

class FakeReplica:
    def __init__(self, load=0, match=0, available=True, cached_blocks=0):
        self.load, self.match, self.available = load, match, available
        self.cached_blocks = cached_blocks

    def match_tokens(self, request):
        return self.match


class Req:
    def __init__(self, hashes):
        self.block_hashes = hashes


def test_policies_skip_unavailable_replicas():
    reps = [FakeReplica(available=False), FakeReplica(), FakeReplica(available=False)]
    rr = RoundRobinPolicy()
    assert [rr.choose(Req([1]), reps) for _ in range(3)] == [1, 1, 1]
    assert LeastLoadedPolicy().choose(Req([1]), reps) == 1
    ch = ConsistentHashPolicy(3, 16)
    assert all(ch.choose(Req([h]), reps) == 1 for h in range(1, 200, 7))
    reps[1].match = 0
    assert CacheAwarePolicy().choose(Req([1]), reps) == 1
    with pytest.raises(NoReplicaAvailable):
        LeastLoadedPolicy().choose(Req([1]), [FakeReplica(available=False)])


def test_cache_aware_follows_the_prefix_and_spills_when_hot():
    policy = CacheAwarePolicy(balance_factor=1.25)
    reps = [FakeReplica(load=1), FakeReplica(load=1, match=64), FakeReplica(load=1)]
    assert policy.choose(Req([1]), reps) == 1 and policy.last_reason == "affinity"
    reps[1].load = 6  # bound: ceil(1.25 * (8 + 1) / 3) = 4 < 7
    assert policy.choose(Req([1]), reps) == 0 and policy.last_reason == "spill"
    for r in reps:
        r.match = 0
    reps[0].load = 3
    assert policy.choose(Req([1]), reps) == 2 and policy.last_reason == "least_loaded"


def test_a_balance_slack_keeps_affinity_at_low_load_and_zero_changes_nothing():
    from kvserve.router.policies import load_bound

    for loads in ([0, 0, 0, 0], [1, 0, 0, 0], [5, 9, 2, 7], [40, 3, 3, 3]):
        mean_bound = max(1, -(-5 * (sum(loads) + 1) // (4 * len(loads))))
        assert load_bound(loads, 1.25) == load_bound(loads, 1.25, 0) == mean_bound
    reps = [FakeReplica(load=1, match=64), FakeReplica(), FakeReplica(), FakeReplica()]
    assert CacheAwarePolicy(1.25).choose(Req([1]), reps) == 1  # 2 > ceil(1.25 * 2 / 4)
    assert CacheAwarePolicy(1.25, balance_slack=4).choose(Req([1]), reps) == 0
    reps[0].load = 4
    assert CacheAwarePolicy(1.25, balance_slack=4).choose(Req([1]), reps) == 1


def test_spread_sends_new_prefixes_to_the_emptiest_of_the_least_loaded():
    reps = [FakeReplica(cached_blocks=30), FakeReplica(cached_blocks=10),
            FakeReplica(cached_blocks=20), FakeReplica(load=1)]
    assert CacheAwarePolicy().choose(Req([1]), reps) == 0  # the simulator's rule: lowest index
    assert CacheAwarePolicy(spread=True).choose(Req([1]), reps) == 1


def test_least_loaded_prefers_fewest_in_flight():
    reps = [FakeReplica(load=3), FakeReplica(load=1), FakeReplica(load=1)]
    assert LeastLoadedPolicy().choose(Req([]), reps) == 1


def test_prefix_view_counts_leading_blocks_and_is_bounded():
    view = PrefixView(capacity_blocks=4)
    view.add([1, 2, 3])
    assert view.match_blocks([1, 2, 3, 4]) == 3
    view.remove([2])
    assert view.match_blocks([1, 2, 3]) == 1
    view.add([5, 6, 7])  # 1, 3, 5, 6, 7: the oldest (1) goes
    assert len(view) == 4 and 1 not in view and view.match_blocks([3]) == 1
    view.clear()
    assert len(view) == 0


def test_prefix_keys_are_the_engines_block_hashes():
    keyer = PrefixKeyer(16)
    ids = list(range(3, 60))
    assert keyer.keys("/v1/completions", {"prompt": ids}) == chain_hashes(ids, 16)
    assert keyer.keys("/v1/completions", {"prompt": [ids, [1, 2]]}) == chain_hashes(ids, 16)
    salted = keyer.keys("/v1/completions", {"prompt": ids, "cache_salt": "tenant-a"})
    assert salted == chain_hashes(ids, 16, extra_keys("tenant-a")) and salted[0] != \
        chain_hashes(ids, 16)[0]
    # without a tokenizer, text keys still name prefixes: equal leading text, equal leading keys
    a = keyer.keys("/v1/completions", {"prompt": "x" * 200 + "tail one"})
    b = keyer.keys("/v1/completions", {"prompt": "x" * 200 + "other tail"})
    assert a[:3] == b[:3] and len(a) == 3
    assert keyer.keys("/v1/completions", {"prompt": 5}) == []
    assert keyer.keys("/v1/chat/completions", {"messages": "nope"}) == []


def test_kv_event_log_is_bounded_and_reports_drops():
    log = KVEventLog(3)
    for h in range(5):
        log.record("BlockStored", h + 1, h)
    events, dropped = log.drain()
    assert [e.block_hash for e in events] == [3, 4, 5] and dropped == 2
    assert log.drain() == ([], 0)
    off = KVEventLog(0)
    off.record("BlockStored", 1, 0)
    assert off.drain() == ([], 0)


def test_prefix_index_records_stores_evictions_and_resets():
    from kvserve.kv.manager import KVCacheManager
    from kvserve.sim.replay import SimSeq

    kv = KVCacheManager(4, 4, kv_events_capacity=100)
    seq = SimSeq("a", list(range(1, 13)))
    kv.admit(seq, kv.match(seq), 12)
    seq.num_computed_tokens = 12
    kv.cache_full_blocks(seq)
    kv.free(seq)
    events, _ = kv.drain_events()
    hashes = chain_hashes(list(range(1, 13)), 4)
    assert [(e.kind, e.block_hash, e.parent_hash) for e in events] == [
        ("BlockStored", hashes[0], 0), ("BlockStored", hashes[1], hashes[0]),
        ("BlockStored", hashes[2], hashes[1])]
    other = SimSeq("b", list(range(100, 116)))  # 4 blocks: every cached one must go
    assert kv.admit(other, kv.match(other), 16) is not None
    removed = [e.block_hash for e in kv.drain_events()[0]]
    assert sorted(removed) == sorted(hashes)  # leaves first, all three
    kv.free(other)
    kv.reset_prefix_cache()
    assert [e.kind for e in kv.drain_events()[0]] == ["AllBlocksCleared"]


def test_hollowed_window_blocks_stay_in_the_gateways_picture():
    """A windowed index hollows an idle interior block (its descendants stay reachable, and a
    deep hit needs only the window's blocks): no BlockRemoved for it then, so a gateway, which
    counts leading hashes until the first miss, still sees the whole prefix; when the hollow
    node leaves the tree (its last child evicted), its BlockRemoved comes."""
    from kvserve.kv.block_pool import NULL_BLOCK
    from kvserve.kv.manager import KVCacheManager
    from kvserve.sim.replay import SimSeq

    kv = KVCacheManager(5, 4, kv_events_capacity=100, window=4)
    tokens = list(range(1, 17))  # 4 full blocks; the window needs the last one or two
    hashes = chain_hashes(tokens, 4)
    seq = SimSeq("a", tokens)
    kv.admit(seq, kv.match(seq), 16)
    seq.num_computed_tokens = 16
    kv.cache_full_blocks(seq)
    kv.free(seq)
    view = PrefixView()
    apply = [(e.kind, e.block_hash) for e in kv.drain_events()[0]]
    assert apply == [("BlockStored", h) for h in hashes]
    view.add(hashes)
    evicted = kv.index.evict(2)  # the two oldest, shallowest: interior nodes turn hollow
    assert len(evicted) == 2 and all(n.block == NULL_BLOCK for n in evicted)
    assert kv.drain_events()[0] == []  # nothing the gateway should drop
    assert kv.match(SimSeq("b", tokens + [99])).num_tokens == 16  # the replica still hits all
    assert view.match_blocks(hashes) == 4
    kv.index.evict(10)  # the leaf goes, then every hollow node above it
    removed = {e.block_hash for e in kv.drain_events()[0] if e.kind == "BlockRemoved"}
    assert removed == set(hashes)
    view.remove(removed)
    assert view.match_blocks(hashes) == 0


def test_event_publisher_flags_lost_events():
    from kvserve.server.kv_events import KVEventPublisher

    from kvserve.engine.stats import EngineStats
    from kvserve.kv.events import KVEvent

    def snapshot(events, dropped):  # what the engine hands its stat loggers
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, kv_events=tuple(events),
                           kv_events_dropped=dropped)

    pub = KVEventPublisher(capacity=2)
    ev = [KVEvent("BlockStored", i, 0) for i in range(1, 4)]
    pub.on_idle(snapshot(ev, 0))  # three into a ring of two: event 0 is gone

    async def poll(since):
        return await pub.poll(since, 0)

    first = asyncio.run(poll(-1))
    assert first["lost"] and [e["seq"] for e in first["events"]] == [1, 2]
    assert asyncio.run(poll(0))["lost"] is False
    assert asyncio.run(poll(2)) == {"epoch": pub.epoch, "lost": False, "last_seq": 2,
                                    "events": []}
    pub.on_idle(snapshot([], 5))  # the engine dropped five before they were drained
    gap = asyncio.run(poll(2))
    assert gap["lost"] and gap["events"] == []


# ------------------------------------------------------------------------------------------
# the gateway in-process, over fake replicas (httpx.MockTransport)
# ------------------------------------------------------------------------------------------

def _fake_gateway(handler, n: int = 2, policy: str = "round_robin"):
    from kvserve.router.app import Gateway, RouterConfig, build_router_app
    from kvserve.router.policies import make_policy
    from kvserve.router.replicas import ReplicaState

    replicas = [ReplicaState(i, f"http://replica{i}", 16) for i in range(n)]
    gw = Gateway(replicas, make_policy(policy, n, 16), PrefixKeyer(16),
                 RouterConfig(health_interval_s=60, kv_events=False),
                 transport=httpx.MockTransport(handler))
    return gw, build_router_app(gw)


async def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            return await c.request(method, path, **kw)


def test_a_503_or_refused_connection_is_retried_on_another_replica():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        calls.append(request.url.host)
        if request.url.host == "replica0":
            return httpx.Response(503, json={"error": {"message": "engine dead"}})
        if request.url.host == "replica1":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"ok": request.url.host})

    gw, app = _fake_gateway(handler, n=3)
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": [1, 2, 3]}))
    assert r.status_code == 200 and r.json() == {"ok": "replica2"}
    assert calls == ["replica0", "replica1", "replica2"] and r.headers["x-kvserve-replica"] == "2"
    assert not gw.replicas[1].healthy and gw.replicas[0].healthy  # refused: out; 503: kept
    assert all(rep.in_flight == 0 for rep in gw.replicas)
    text = gw.metrics.render().decode()
    assert "kvserve:router_retries_total 2.0" in text
    assert 'kvserve:router_errors_total{kind="status",replica="0"} 1.0' in text


def test_no_replica_left_is_a_503_and_a_request_error_is_not_retried():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.host == "replica0":
            return httpx.Response(400, json={"error": {"message": "bad"}})
        return httpx.Response(502)

    gw, app = _fake_gateway(handler)
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": "x"}))
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad"  # replica 0's answer
    assert "kvserve:router_retries_total 0.0" in gw.metrics.render().decode()

    def all_down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200) if request.url.path == "/health" else httpx.Response(502)

    gw, app = _fake_gateway(all_down)
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": "x"}))
    assert r.status_code == 503 and "no replica could take" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413_at_the_gateway():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/health":
            seen.append(request)
        return httpx.Response(200, json={})

    gw, app = _fake_gateway(handler)
    gw.config.max_request_body_bytes = 1000
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": "x" * 2000}))
    assert r.status_code == 413 and "larger than 1,000 bytes" in r.json()["error"]["message"]

    async def chunked():  # no Content-Length: counted while read
        for _ in range(5):
            yield b"x" * 300

    r = asyncio.run(_call(app, "POST", "/v1/completions", content=chunked()))
    assert r.status_code == 413 and not seen
    assert asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": "ok"})
                       ).status_code == 200


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, stream=Broken(),
                              headers={"content-type": "text/event-stream"})

    gw, app = _fake_gateway(handler, n=1)
    r = asyncio.run(_call(app, "POST", "/v1/completions", json={"prompt": "x", "stream": True}))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    err = json.loads(events[1])["error"]
    assert err["code"] == 502 and "broke" in err["message"] and events[2] == "[DONE]"
    assert gw.replicas[0].in_flight == 0
    assert 'kvserve:router_errors_total{kind="stream_cut",replica="0"} 1.0' in \
        gw.metrics.render().decode()


# ------------------------------------------------------------------------------------------
# real processes
# ------------------------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path) -> None:
        self.name, self.port, self.argv, self.log_dir = name, port, argv, log_dir
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self) -> None:
        self.log_path = self.log_dir / f"{self.name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *self.argv,
                                      "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, path: str = "/health", timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def replica_model() -> str:
    """The replicas serve the tiny random-weight Qwen2 under the name "default": routing is
    under test here, not the model (the embedded SmolLM2 would cost each replica 0.5 GB)."""
    from kvserve.model_loader.make_model import ensure_default_model

    return str(ensure_default_model())


def replica(name: str, log_dir: Path, port: int | None = None, extra=()) -> Proc:
    return Proc(name, ["serve", replica_model(), "--served-model-name", "default",
                       "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1",
                       "--max-num-seqs", "4", "--disable-log-stats", *extra],
                port or free_port(), log_dir)


def gateway(replicas: list[Proc], log_dir: Path, *flags: str) -> Proc:
    argv = ["route", "--health-interval", "0.3"]
    for r in replicas:
        argv += ["--replica", r.url]
    return Proc("gateway", argv + list(flags), free_port(), log_dir)


KEY, ADMIN_KEY = "sk-gw", "sk-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two replicas with an API key and an admin key (server/auth.py), behind a cache_aware
    gateway that tokenizes like them and reads their KV events with the admin key, and a
    second gateway over the same replicas that checks the API key itself."""
    log_dir = tmp_path_factory.mktemp("router-logs")
    reps = [replica(f"replica{i}", log_dir, extra=["--api-key", KEY, "--admin-api-key",
                                                   ADMIN_KEY]) for i in range(2)]
    gw = gw_key = None
    try:
        for r in reps:
            r.wait_ready()
        gw = gateway(reps, log_dir, "--policy", "cache_aware", "--tokenizer",
                     replica_model(), "--admin-api-key", ADMIN_KEY)
        gw_key = gateway(reps, log_dir, "--policy", "round_robin", "--api-key", KEY,
                         "--admin-api-key", ADMIN_KEY)
        gw.wait_ready()
        gw_key.wait_ready()
        yield {"replicas": reps, "gateway": gw, "keyed_gateway": gw_key}
    finally:
        for p in [gw, gw_key, *reps]:
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["gateway"].url + "/v1", api_key=KEY,
                         max_retries=0, timeout=120)


SYSTEM = "You are a careful assistant who answers questions about paged KV caches. " * 6


@pytest.mark.timeout(300)
def test_openai_client_through_the_gateway(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not/served")
    out = client.completions.create(model="default", prompt="Hello there", max_tokens=5,
                                    temperature=0.0, n=2)
    assert len(out.choices) == 2 and out.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="default", prompt="Once upon", max_tokens=6,
                                            stream=True, n=2, temperature=0.0,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert chunks[-1].usage.completion_tokens == 12 and all(texts.values())
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True)
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] == "length"


@pytest.mark.timeout(300)
def test_errors_pass_through_with_their_status_codes(client, cluster):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):  # over max_model_len: the replica's 400
        client.completions.create(model="default", prompt=[5] * (MAX_MODEL_LEN + 1),
                                  max_tokens=1)
    r = httpx.post(cluster["gateway"].url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json",
                            "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(cluster["gateway"].url + "/nowhere").status_code == 404
    # --api-key is checked at the gateway (401 there) and sent on to the replicas; without it
    # the replicas judge the client's key (their 401 passes through)
    keyed = cluster["keyed_gateway"].url
    for url in (keyed, cluster["gateway"].url):
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="default", prompt="hi", max_tokens=2)
    good = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="default", prompt="hi", max_tokens=2).choices


@pytest.mark.timeout(300)
def test_anthropic_messages_through_the_gateway(cluster):
    """/v1/messages is routed as chat is: Anthropic's SDK through the cache-aware gateway
    keeps a shared system prompt on one replica (its later requests read the cache); the
    gateway that checks keys takes x-api-key and answers a wrong one in Anthropic's shape."""
    import anthropic

    gw = anthropic.Anthropic(base_url=cluster["gateway"].url, api_key=KEY, max_retries=0,
                             timeout=120)
    served, read = [], []
    for i in range(3):
        raw = gw.messages.with_raw_response.create(
            model="default", max_tokens=2, system="Anthropic route. " + SYSTEM,
            messages=[{"role": "user", "content": f"question {i}"}])
        served.append(raw.headers["x-kvserve-replica"])
        read.append(raw.parse().usage.cache_read_input_tokens)
    assert len(set(served)) == 1 and all(r > 100 for r in read[1:]), (served, read)
    keyed = cluster["keyed_gateway"].url
    good = anthropic.Anthropic(base_url=keyed, api_key=KEY, max_retries=0)
    assert good.messages.count_tokens(model="default", messages=[
        {"role": "user", "content": "hi"}]).input_tokens > 0
    with good.messages.stream(model="default", max_tokens=3,
                              messages=[{"role": "user", "content": "hi"}]) as stream:
        assert stream.get_final_message().usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed, api_key="wrong", max_retries=0).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.timeout(300)
def test_cache_aware_keeps_a_prefix_on_one_replica_and_events_confirm_the_keys(client,
                                                                             cluster):
    gw = cluster["gateway"].url
    served, cached = [], []
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="default", max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"question number {i}"}])
        served.append(raw.headers["x-kvserve-replica"])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(set(served)) == 1, served
    assert all(c > 100 for c in cached[1:]), cached
    # The gateway's keys (its own tokenizer and chat template) are the replica's block hashes:
    # every full block of the prompt but the last token was published as BlockStored.
    from kvserve.tokenizer.tokenizer import Tokenizer

    keyer = PrefixKeyer(16, Tokenizer.from_dir(replica_model()))
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "question number 0"}]}
    keys = keyer.keys("/v1/chat/completions", body)
    rep = cluster["replicas"][int(served[0])]
    assert httpx.get(rep.url + "/v1/kv_events", params={"since": -1},
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 403
    events = httpx.get(rep.url + "/v1/kv_events", params={"since": -1},
                       headers=ADMIN).json()["events"]
    stored = {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    assert len(keys) >= 8 and set(keys[:-1]) <= stored
    # ... and the gateway received them (its metrics count the events by replica)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = httpx.get(gw + "/replicas").json()["replicas"][int(served[0])]
        if state["known_blocks"] >= len(keys) - 1:
            break
        time.sleep(0.2)
    assert state["known_blocks"] >= len(keys) - 1
    text = httpx.get(gw + "/metrics").text
    assert f'kvserve:router_kv_events_total{{replica="{served[0]}",type="BlockStored"}}' in text
    assert 'reason="affinity"' in text
    # a reset on the replica reaches the gateway as AllBlocksCleared
    assert httpx.post(rep.url + "/reset_prefix_cache", headers=ADMIN).status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if httpx.get(gw + "/replicas").json()["replicas"][int(served[0])]["known_blocks"] == 0:
            break
        time.sleep(0.2)
    assert httpx.get(gw + "/replicas").json()["replicas"][int(served[0])]["known_blocks"] == 0


async def _stream(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                  started: asyncio.Event | None = None):
    """One streaming completion: (replica, chunks received, finished normally, error)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks, error, done = 0, None, False
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None, 0, False, f"HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]["message"]
            else:
                chunks += 1
                if started is not None:
                    started.set()
        return r.headers.get("x-kvserve-replica"), chunks, done and error is None, error


@pytest.mark.timeout(400)
def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started(tmp_path):
    """Streams cut mid-way end with an error event; requests that had not started (queued on
    the killed replica, or sent after) are retried on the other replica; the gateway takes the
    dead replica out and re-admits it once it is back."""
    reps = [replica(f"fo{i}", tmp_path) for i in range(2)]
    gw = None
    try:
        for r in reps:
            r.wait_ready()
        gw = gateway(reps, tmp_path, "--policy", "round_robin")
        gw.wait_ready()

        async def complete(http: httpx.AsyncClient, prompt: list[int]):
            # As long as the streams above, which are still running when the replica dies: a
            # shorter one could finish on replica 1 before the kill on a fast machine.
            r = await http.post(gw.url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 480, "ignore_eos": True})
            return r.headers.get("x-kvserve-replica"), r.status_code

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                flowing = [asyncio.Event() for _ in range(4)]
                long = [asyncio.create_task(_stream(http, gw.url, [7 + i] * 20, 480, ev))
                        for i, ev in enumerate(flowing)]
                for ev in flowing:  # every long stream has sent its first chunk
                    await ev.wait()
                # in flight on both replicas, not streaming: nothing of them reached the client
                pending = [asyncio.create_task(complete(http, [30 + i] * 20)) for i in range(4)]
                await asyncio.sleep(0.3)
                reps[1].kill()
                after = await asyncio.gather(*(_stream(http, gw.url, [50 + i] * 20, 4)
                                               for i in range(6)))
                return (await asyncio.gather(*long), await asyncio.gather(*pending), after)

        long, pending, after = asyncio.run(asyncio.wait_for(run(), 300))
        cut = [x for x in long if x[0] == "1"]
        assert cut and all(x[3] and "broke" in x[3] and x[1] > 0 for x in cut), long
        assert all(x[2] for x in long if x[0] == "0"), long
        assert all(status == 200 and rep == "0" for rep, status in pending), pending
        assert all(x[2] and x[0] == "0" for x in after), after  # none failed, all on 0
        text = httpx.get(gw.url + "/metrics").text
        assert 'kvserve:router_errors_total{kind="stream_cut",replica="1"}' in text
        assert httpx.get(gw.url + "/health").json()["healthy_replicas"] == 1
        reps[1].start()  # back on the same port
        reps[1].wait_ready()
        deadline = time.monotonic() + 20
        while httpx.get(gw.url + "/health").json()["healthy_replicas"] != 2:
            assert time.monotonic() < deadline, "the replica was not re-admitted"
            time.sleep(0.2)
    finally:
        for p in [gw, *reps]:
            if p is not None:
                p.stop()


@pytest.mark.timeout(400)
def test_with_a_shared_redis_tier_a_prefix_computed_on_one_replica_hits_on_another(
        tmp_path, redis_server):
    """The scale-out story: replicas share a Redis tier (write-through), so a prefix computed
    on one replica is a remote hit on another, even when the gateway routes blindly."""
    tiers = json.dumps({"chunk_size": 64, "local_cpu": False, "remote_url": redis_server.url,
                        "write_policy": "write_through", "model_name": "tiny"})
    reps = [replica(f"redis{i}", tmp_path, extra=["--kv-tier-config", tiers]) for i in range(2)]
    gw = None
    try:
        for r in reps:
            r.wait_ready()
        gw = gateway(reps, tmp_path, "--policy", "round_robin")
        gw.wait_ready()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        prefix = [11 + (i * 7) % 1500 for i in range(256)]
        first = client.completions.with_raw_response.create(
            model="default", prompt=prefix + [3, 4, 5], max_tokens=2)
        assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(1.0)  # the write-through saves run on a background thread
        second = client.completions.with_raw_response.create(
            model="default", prompt=prefix + [6, 7, 8], max_tokens=2)
        assert second.headers["x-kvserve-replica"] != first.headers["x-kvserve-replica"]
        assert second.parse().usage.prompt_tokens_details.cached_tokens >= 192
        other = reps[int(second.headers["x-kvserve-replica"])]
        metrics = httpx.get(other.url + "/metrics").text
        remote = [line for line in metrics.splitlines()
                  if line.startswith("kvserve:prefix_cache_hits_by_source_total")
                  and 'source="remote"' in line]
        assert remote and float(remote[0].rsplit(" ", 1)[1]) >= 192, remote
    finally:
        for p in [gw, *reps]:
            if p is not None:
                p.stop()
