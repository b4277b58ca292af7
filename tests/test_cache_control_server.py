"""Retention control and tenant quotas through a real `kvserve serve` process (issue 33,
acceptance 3 and 4): pins, the pinned-fraction limit, a TTL that runs out, cache_control and
kv_retention fields, and one tenant's burst against another's hot prefix, with quotas on and off.
What is cached is read back through /v1/cache/explain and the responses' cached-token counts."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from helpers import kv_bytes_per_token
from server_process import ServerProcess, all_running

BS = 16
POOL_BLOCKS = 300
PIN_TOKENS = 2000  # 125 blocks: under --max-pinned-fraction 0.5 (150), two of them are not


def toks(seed: int, n: int, vocab: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _server(name: str, extra: list[str], tmp_path_factory) -> ServerProcess:
    from kvserve.model_loader.make_model import ensure_default_model

    tiny = str(ensure_default_model())
    return ServerProcess(name, [tiny, "--block-size", str(BS), "--dtype", "float32",
                                "--kv-cache-memory-bytes",
                                str(POOL_BLOCKS * BS * kv_bytes_per_token(tiny)), *extra],
                         tmp_path_factory.mktemp(f"{name}-logs"), max_model_len=2048)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    procs = {"plain": _server("plain", [], tmp_path_factory),
             "quota": _server("quota", ["--kv-tenant-quota", "0.5", "--kv-tenant-by", "api_key",
                                        "--api-key", "tenant-a", "--api-key", "tenant-b",
                                        "--admin-api-key", "quota-admin"],
                              tmp_path_factory)}
    with all_running(procs):
        yield procs


def complete(server, prompt, headers=None, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def cached(server, prompt, headers=None, **fields) -> int:
    r = httpx.post(f"{server.url}/v1/cache/explain", json={"prompt": prompt, **fields},
                   timeout=60, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["cached_tokens"]


def burst(server, seed: int, count: int = 12, n: int = 500, headers=None) -> list[list[int]]:
    prompts = [toks(seed + i, n) for i in range(count)]
    for p in prompts:
        complete(server, p, headers=headers)
    return prompts


def metric(server, name: str, headers=None) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30, headers=headers).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{")]
    assert values, f"{name} not exported"
    return values[0]


def test_pin_survives_a_burst_and_the_limit_is_enforced(servers):
    s = servers["plain"]
    prefix = toks(1, PIN_TOKENS)
    r = httpx.post(f"{s.url}/v1/cache/pin", json={"prompt": prefix}, timeout=120)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["object"] == "cache.pin" and pin["num_tokens"] == PIN_TOKENS
    assert pin["num_blocks"] == PIN_TOKENS // BS
    query = prefix + toks(2, 20)
    assert cached(s, query) == PIN_TOKENS
    plain = toks(3, 800)
    complete(s, plain)
    first = burst(s, 100)  # 6,000 tokens through a pool with 175 unpinned blocks
    assert cached(s, first[0]) == 0 and cached(s, plain) == 0, "the burst evicted everything"
    assert cached(s, query) == PIN_TOKENS, "the pinned prefix stayed whole"
    body = complete(s, query)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PIN_TOKENS
    # a second pin would take 125 more blocks: over 0.5 of 300
    r = httpx.post(f"{s.url}/v1/cache/pin", json={"prompt": toks(4, PIN_TOKENS)}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--max-pinned-fraction 0.5" in err["message"] and err["code"] == "pin_limit"
    assert cached(s, toks(4, PIN_TOKENS)) == 0, "a refused pin ran no prefill"
    listed = httpx.get(f"{s.url}/v1/cache/pins", timeout=30).json()
    assert [p["id"] for p in listed["data"]] == [pin["id"]]
    assert listed["num_pinned_blocks"] == 125 and listed["limit_blocks"] == 150
    assert metric(s, "kvserve:kv_pinned_blocks") == 125 and metric(s, "kvserve:kv_pins") == 1
    # unpinned, it is an ordinary idle prefix: the next burst takes it
    assert httpx.delete(f"{s.url}/v1/cache/pin/{pin['id']}", timeout=30).status_code == 200
    assert httpx.delete(f"{s.url}/v1/cache/pin/{pin['id']}", timeout=30).status_code == 404
    burst(s, 200)
    assert cached(s, query) == 0


def test_pin_of_messages_and_bad_pins(servers):
    s = servers["plain"]
    messages = [{"role": "system", "content": "You answer briefly. " * 40}]
    r = httpx.post(f"{s.url}/v1/cache/pin", json={"messages": messages}, timeout=120)
    assert r.status_code == 200, r.text
    pin = r.json()
    chat = messages + [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{s.url}/v1/cache/explain", json={"messages": chat}, timeout=60)
    assert r.json()["cached_tokens"] >= pin["num_tokens"] > 0
    assert httpx.delete(f"{s.url}/v1/cache/pin/{pin['id']}", timeout=30).status_code == 200
    for body, status, what in [({"prompt": [5] * 8}, 400, "shorter than one KV block"),
                               ({}, 400, "prompt or messages"),
                               ({"prompt": [5] * 40, "model": "nope"}, 404, "nope")]:
        r = httpx.post(f"{s.url}/v1/cache/pin", json=body, timeout=60)
        assert r.status_code == status and what in r.text, r.text


def test_ttl_runs_out_and_fields_are_checked(servers):
    """kv_retention priority 100 for 3 s: a burst inside the TTL leaves it, one after the TTL
    takes it (it is back at the default priority, and the oldest)."""
    s = servers["plain"]
    hot = toks(5, 600)
    complete(s, hot, kv_retention={"priority": 100, "ttl": "3s"})
    start = time.monotonic()
    burst(s, 300, count=6)
    assert time.monotonic() - start < 3, "the burst outlasted the TTL: the test proves nothing"
    assert cached(s, hot) == 592
    time.sleep(max(0.0, 3.2 - (time.monotonic() - start)))
    burst(s, 400, count=6)
    assert cached(s, hot) == 0
    # a cache_control breakpoint on a message is taken; bad ones are 400s naming the field
    chat = {"messages": [{"role": "system", "content": "be brief",
                          "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                         {"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    for fields, param in [({"cache_control": {"type": "ephemeral", "ttl": "2h"}},
                           "cache_control"),
                          ({"kv_retention": {"priority": 101}}, "kv_retention")]:
        r = httpx.post(f"{s.url}/v1/completions",
                       json={"prompt": "hello", "max_tokens": 1, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad = dict(chat, messages=[dict(chat["messages"][0], cache_control={"type": "x"}),
                               chat["messages"][1]])
    r = httpx.post(f"{s.url}/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].cache_control"


def test_tenant_quota_keeps_another_tenants_prefix(servers):
    """Tenant B's hot prefix, then tenant A's burst of distinct prompts (tenants by API key):
    with --kv-tenant-quota 0.5 B's prefix stays; on the server without quotas it goes."""
    a, b = {"Authorization": "Bearer tenant-a"}, {"Authorization": "Bearer tenant-b"}
    hot = toks(7, 1000)
    for name, stays in [("quota", True), ("plain", False)]:
        s = servers[name]
        complete(s, hot, headers=b)
        burst(s, 500, count=16, headers=a)
        assert cached(s, hot, headers=b) == (992 if stays else 0), name
    admin = {"Authorization": "Bearer quota-admin"}  # per-tenant series: the admin's scrape
    assert metric(servers["quota"], "kvserve:kv_tenant_idle_cached_blocks", admin) > 0


def test_message_breakpoint_keeps_the_conversation_up_to_it(servers):
    """A breakpoint on the system message of a chat: after a burst, the conversation up to the
    system message's end is still cached and the rest (the user's turn) is not; the same chat
    without the breakpoint loses everything to the same burst."""
    s = servers["plain"]
    system = " ".join(f"rule {i}: answer in one sentence." for i in range(60))
    user = " ".join(f"question part {i}" for i in range(40))

    def chat(tag: str, control: bool) -> list[dict]:
        sys_msg = {"role": "system", "content": f"{tag} {system}"}
        if control:
            sys_msg["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        return [sys_msg, {"role": "user", "content": user}]

    def explain(messages) -> dict:
        r = httpx.post(f"{s.url}/v1/cache/explain", json={"messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    for tag, control in (("marked", True), ("plain", False)):
        messages = chat(tag, control)
        r = httpx.post(f"{s.url}/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200, r.text
        full = explain(messages)
        assert full["cached_tokens"] >= full["prompt_tokens"] - BS
        system_only = explain(messages[:1])
        burst(s, 600 if control else 700)
        after = explain(messages)["cached_tokens"]
        if control:
            # the system message's blocks (its last partial block excepted) stayed; the user
            # turn's went
            assert system_only["prompt_tokens"] - 2 * BS <= after <= system_only["prompt_tokens"]
            assert after < full["cached_tokens"] - BS
        else:  # at most the template's opening, shared with the marked chat's first block
            assert after < BS
