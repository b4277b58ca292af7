"""Issue 63, items 4-6: hostile callers against real `kvserve serve` processes.

1. Pins per tenant: two keys' pin budgets (`--max-pinned-fraction`) are independent, one key
   exhausting its own leaves the other's whole; the total cap (`--max-pinned-total-fraction`)
   refuses without other tenants' numbers; listings and errors name the caller's own counts
   only; ids are random (96 bits), not a counter.
2. A keyless server on loopback is not an admin server: every caller gets the ordinary caller's
   private report (no other caller's text, no `salt` reason) and 403 on the cache-wide routes;
   `--allow-unauthenticated-admin` restores the full report and the routes. The start-up line
   says which.
3. Log forging: a newline (or NEL, LINE SEPARATOR, a carriage return) in any string a caller
   controls — `user`, a model name, a URL path, a `kv_transfer_params` peer, a header — never
   starts a line of the server's log.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from helpers import kv_bytes_per_token
from server_process import ServerProcess, all_running
from test_server import _assert_error_shape

from kvserve.model_loader.make_model import ensure_default_model
from kvserve.frontend.tenancy import key_digest

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
BS = 16
POOL_BLOCKS = 64
ALICE, BOB, CAROL, ADMIN = "sk-alice", "sk-bob", "sk-carol", "sk-admin"
# 4 blocks per tenant, 8 in all: two tenants fill the total
PER_TENANT, TOTAL = 0.0625, 0.125
PUBLIC = ("You are the support assistant of Example Bank. Account numbers and PINs in the "
          "records below are confidential: never reveal them.")
SECRET = (" Customer record C-1029, account number 4417-2231-9090, PIN 7731, vault code "
          "5581-0042, asked about opening an account for her daughter.")
SECRET_PIECES = ("1029", "4417", "2231", "9090", "7731", "5581", "0042", "daughter")
GUESS = " Customer record C-5550 asked about opening an"
FORGED = "ERROR 12-07 forged"


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _start(name: str, tmp_path_factory, *flags: str) -> ServerProcess:
    tiny = str(ensure_default_model())
    return ServerProcess(name, [tiny, "--served-model-name", MODEL, "--block-size", str(BS),
                                "--kv-cache-memory-bytes",
                                str(POOL_BLOCKS * BS * kv_bytes_per_token(tiny)),
                                "--max-num-seqs", "4", "--disable-log-stats", *flags],
                         tmp_path_factory.mktemp(f"{name}-logs"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Started at once, so their start-ups overlap: keys with tiny pin budgets, a keyless
    server (loopback, the default host), a keyless one that opens the admin role, and a KV
    consumer (disaggregation), which takes a peer's address from the request."""
    procs = {"keys": _start("hostile-keys", tmp_path_factory, "--api-key", ALICE,
                            "--api-key", BOB, "--api-key", CAROL, "--admin-api-key", ADMIN,
                            "--max-pinned-fraction", str(PER_TENANT),
                            "--max-pinned-total-fraction", str(TOTAL)),
             "keyless": _start("hostile-keyless", tmp_path_factory),
             "open": _start("hostile-open", tmp_path_factory, "--allow-unauthenticated-admin"),
             "consumer": _start("hostile-consumer", tmp_path_factory, "--kv-transfer-config",
                                json.dumps({"kv_connector": "kvserve",
                                            "kv_role": "kv_consumer"}))}
    with all_running(procs):
        yield procs


def _pin(url: str, key: str | None, num_blocks: int, seed: int) -> httpx.Response:
    prompt = [3 + (seed * 131 + i * 7) % 1500 for i in range(num_blocks * BS)]
    return httpx.post(f"{url}/v1/cache/pin", headers=_auth(key), timeout=120,
                      json={"model": MODEL, "prompt": prompt})


def _pins(url: str, key: str | None) -> dict:
    r = httpx.get(f"{url}/v1/cache/pins", headers=_auth(key), timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


# ------------------------------------------------------------------------------------------
# 1. pins per tenant
# ------------------------------------------------------------------------------------------

def test_two_tenants_pins_are_independent_and_say_nothing_of_each_other(servers):
    url = servers["keys"].url
    made: list[str] = []
    try:
        first = _pin(url, ALICE, 4, 1)  # Alice's whole budget
        assert first.status_code == 200, first.text[:300]
        made.append(first.json()["id"])
        refused = _assert_error_shape(_pin(url, ALICE, 1, 2), 400)
        assert refused["code"] == "pin_limit" and "your budget of 4" in refused["message"]
        # Alice's exhausted budget leaves Bob's whole
        bob = _pin(url, BOB, 2, 3)
        assert bob.status_code == 200, bob.text[:300]
        made.append(bob.json()["id"])
        listed = _pins(url, BOB)
        assert [p["id"] for p in listed["data"]] == [bob.json()["id"]]
        assert (listed["num_pinned_blocks"], listed["limit_blocks"]) == (2, 4)
        assert key_digest(ALICE) not in json.dumps(listed)
        # Bob's refusal names his own count (2 + 3 = 5 of 4), never the server's (6, 9)
        over = _assert_error_shape(_pin(url, BOB, 3, 4), 400)
        assert over["code"] == "pin_limit" and "hold 5 blocks" in over["message"]
        assert not _numbers(over["message"]) & {6, 9}, over["message"]
        fill = _pin(url, BOB, 2, 5)
        assert fill.status_code == 200, fill.text[:300]
        made.append(fill.json()["id"])
        # 8 of 8 pinned in all: Carol's own budget is untouched, the total cap refuses, and
        # says so without the server's count
        capped = _assert_error_shape(_pin(url, CAROL, 1, 6), 400)
        assert capped["code"] == "pin_limit" and "across all tenants" in capped["message"]
        assert not _numbers(capped["message"]) & {8, 9, POOL_BLOCKS}, capped["message"]
        assert _pins(url, CAROL) | {"data": None} == {
            "object": "list", "data": None, "num_pinned_blocks": 0, "limit_blocks": 4,
            "max_pinned_fraction": PER_TENANT, "max_pinned_total_fraction": TOTAL}
        # the admin sees every pin and the server-wide count
        admin = _pins(url, ADMIN)
        assert sorted(p["id"] for p in admin["data"]) == sorted(made)
        assert admin["num_pinned_blocks"] == 8
        # ids: 96 random bits each, no counter between them
        assert all(re.fullmatch(r"pin-[0-9a-f]{24}", i) for i in made), made
        values = sorted(int(i[4:], 16) for i in made)
        assert all(b - a > 2 ** 32 for a, b in zip(values, values[1:])), made
        # an open scrape names no tenant
        assert key_digest(ALICE) not in httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        for pin_id in made:
            httpx.delete(f"{url}/v1/cache/pin/{pin_id}", headers=_auth(ADMIN), timeout=30)


# ------------------------------------------------------------------------------------------
# 2. a keyless server is not an admin server
# ------------------------------------------------------------------------------------------

def _explain(url: str, prompt: str, **fields) -> dict:
    r = httpx.post(f"{url}/v1/cache/explain", timeout=120,
                   json={"model": MODEL, "prompt": prompt, **fields})
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _complete(url: str, prompt: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                            "temperature": 0.0, **fields})


def test_a_keyless_loopback_server_gives_every_caller_a_private_report(servers):
    srv = servers["keyless"]
    assert _complete(srv.url, PUBLIC + SECRET).status_code == 200  # a first caller
    report = _explain(srv.url, PUBLIC + GUESS)  # a second caller, who knows the public part
    assert report["cached_tokens"] > 0
    assert "cached_text" not in report["first_miss"]
    assert not [p for p in SECRET_PIECES if p in json.dumps(report)], report
    streamed = _complete(srv.url, PUBLIC + GUESS, kv_cache_report=True).json()
    assert not [p for p in SECRET_PIECES if p in json.dumps(streamed["kv_cache_report"])]
    # the salt probe reads as a prompt never seen
    probe = _explain(srv.url, PUBLIC + SECRET, cache_salt="prober")
    assert probe["first_miss"]["reason"] == "never_seen", probe
    for method, path in (("POST", "/reset_prefix_cache"), ("GET", "/v1/cache/tree"),
                         ("GET", "/v1/kv_events")):
        err = _assert_error_shape(httpx.request(method, srv.url + path, timeout=30), 403)
        assert "--allow-unauthenticated-admin" in err["message"]
    assert "admin endpoints: off" in srv.log()
    assert "--allow-unauthenticated-admin opens them" in srv.log()


def test_allow_unauthenticated_admin_restores_the_full_report(servers):
    srv = servers["open"]
    assert _complete(srv.url, PUBLIC + SECRET).status_code == 200
    report = _explain(srv.url, PUBLIC + GUESS)
    assert report["first_miss"]["cached_text"].startswith("1029"), report
    probe = _explain(srv.url, PUBLIC + SECRET, cache_salt="prober")
    assert probe["first_miss"]["reason"] == "salt", probe
    assert httpx.get(f"{srv.url}/v1/cache/tree", timeout=30).status_code == 200
    assert httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30).status_code == 200
    assert "admin endpoints: open to every caller" in srv.log()


# ------------------------------------------------------------------------------------------
# 3. log forging
# ------------------------------------------------------------------------------------------

def _send_forgeries(url: str) -> None:
    """Every caller string the server might log, each carrying a forged line; the server may
    refuse some (a 400, a 404): what matters is what it writes."""
    breaks = ("\n", "\r\n", "\r", "\x85", "\u2028", "\u2029")
    for i, br in enumerate(breaks):
        r = _complete(url, "hello", user=f"bob{i}{br}{FORGED} user")
        assert r.status_code == 200, r.text[:300]
    _complete(url, "hello", model=f"tiny\n{FORGED} model")
    long = "hello there " * 40  # whole blocks, so that a consumer asks the peer for them
    _complete(url, long, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": f"127.0.0.1\n{FORGED} host\n",
        "remote_port": 9})
    _complete(url, long + "again", kv_transfer_params={
        "do_remote_prefill": True, "remote_host": "127.0.0.1\n", "remote_port": 9})
    for path in (f"/v1/%0A{FORGED}%20path", f"/v1/completions%0D%0A{FORGED}%20path2",
                 f"/%C2%85{FORGED}%20nel"):
        httpx.post(url + path, json={"prompt": "hi"}, timeout=30)
    for name in ("user-agent", "x-request-id", "x-api-key"):
        try:  # header values may carry obs-text (\x85); line breaks the client refuses
            httpx.post(url + "/v1/completions", timeout=30,
                       headers={name: f"v\x85{FORGED} {name}".encode("latin-1")},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        except httpx.HTTPError:
            pass


@pytest.mark.parametrize("name", ["keyless", "consumer"])
def test_no_caller_string_starts_a_log_line(servers, name):
    srv = servers[name]
    _send_forgeries(srv.url)
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    log = srv.log()
    # the user lines were written, escaped, on their own record's line
    assert f"bob0\\n{FORGED} user" in log, log[-3000:]
    assert f"bob3\\x85{FORGED} user" in log and f"bob4\\u2028{FORGED} user" in log
    # the strictest reader: every Unicode line boundary (\r, NEL, U+2028 ...) ends a line
    forged = [line for line in log.splitlines() if line.lstrip().startswith(FORGED)]
    assert not forged, forged


def test_the_formatter_keeps_a_record_on_its_line_and_a_traceback_as_python_writes_it():
    """In process, what the server's handlers use (kvserve/utils/logging_setup.py): the message and
    the traceback's exception messages escaped, every other traceback line as Python's."""
    import logging
    import sys

    from kvserve.utils.logging_setup import FORMAT, OneLineFormatter, uvicorn_formatter

    def record(msg: str, *args, exc_info=None) -> logging.LogRecord:
        return logging.LogRecord("kvserve", logging.ERROR, __file__, 1, msg, args, exc_info)

    for formatter in (OneLineFormatter(FORMAT), uvicorn_formatter("%(levelprefix)s %(message)s")):
        for br in ("\n", "\r", "\x85", "\u2028", "\u2029", "\x1b[2K\r"):
            text = formatter.format(record("user %s", f"bob{br}{FORGED}"))
            assert len(text.splitlines()) == 1 and FORGED in text, repr(text)
    try:
        try:
            raise KeyError("k")
        except KeyError as inner:
            raise ValueError(f"caller said\n{FORGED}") from inner
    except ValueError:
        info = sys.exc_info()
    text = OneLineFormatter(FORMAT).format(record("failed", exc_info=info))
    assert not [line for line in text.splitlines() if line.startswith(FORGED)], text
    assert f"ValueError: caller said\\n{FORGED}" in text and "KeyError: 'k'" in text
    assert "The above exception was the direct cause" in text
    try:
        {}["nothing to escape"]
    except KeyError:
        info = sys.exc_info()
    assert OneLineFormatter().formatException(info) == logging.Formatter().formatException(info)
