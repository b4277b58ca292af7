"""Issue 54: one caller must not read or steer another caller's cache.

Against real `kvserve serve` processes (the tiny random-weight model; its tokenizer is a real
byte-level BPE, so text round-trips):

1. The attack as it was reported, made a loop: a first caller sends a prompt holding secrets; a
   second caller, who knows only its public start, asks `/v1/cache/explain` and then real
   completions with `kv_cache_report`, appending whatever cached text comes back and asking
   again. It must recover no token it did not send; the salt probe (the first caller's exact
   prompt under the second caller's own salt) must answer exactly as for a prompt never seen;
   and the same loop with the admin key must still read the secret (the diagnosis is kept, and
   the loop is able to fail).
2. The matrix of routes x credentials (none, a wrong key, an ordinary key, the admin key):
   every cache-wide route is 401 / 401 / 403 (OpenAI's error shape; the openai client's
   PermissionDeniedError) / 200; pins are each caller's own.
3. `--kv-isolation api_key`: the second key's identical prompt reports 0 cached tokens and
   computes every prompt token (the server's hit counter does not move), each key's repeat still
   hits, a salt subdivides within a key, quotas count one tenant per key, and the gateway's
   prefix keys under api_key are the replica's block hashes of that key's requests alone.
4. A server without keys serves no admin endpoint (on loopback too: tests/test_hostile_access.py);
   flags that cannot work together fail at start-up with a message, before the model loads.

That isolation changes no output is the differential test
(tests/test_differential.py::test_kv_isolation_does_not_change_outputs).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from server_process import ServerProcess
from test_server import _assert_error_shape

from kvserve.model_loader.make_model import ensure_default_model
from kvserve.server.auth import AccessPolicy
from kvserve.frontend.tenancy import Credentials, cache_namespace, key_digest, read_key_file

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
ALICE, MALLORY, ADMIN = "sk-alice", "sk-mallory", "sk-admin"
PUBLIC = ("You are the support assistant of Example Bank. Account numbers and PINs in the "
          "records below are confidential: never reveal them.")
SECRET = (" Customer record C-1029, account number 4417-2231-9090, PIN 7731, vault code "
          "5581-0042, asked about opening an account for her daughter.")
SECRET_PIECES = ("1029", "4417", "2231", "9090", "7731", "5581", "0042", "daughter")
GUESS = " Customer record C-"  # what the prober knows of the prompt after PUBLIC
FILLER = "5550 asked about opening an"  # its guess at the rest (wrong)


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _server(name: str, tmp_path_factory, *flags: str) -> ServerProcess:
    srv = ServerProcess(name, [str(ensure_default_model()), "--served-model-name", MODEL,
                               "--max-num-seqs", "8", "--disable-log-stats", *flags],
                        tmp_path_factory.mktemp(f"{name}-logs"))
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The default isolation (cache_salt): two ordinary keys and an admin key."""
    srv = _server("tenancy-shared", tmp_path_factory, "--api-key", ALICE, "--api-key", MALLORY,
                  "--admin-api-key", ADMIN)
    yield srv
    srv.stop()


def _complete(url: str, key: str, prompt, **fields) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=_auth(key), timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                         **fields})
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _explain(url: str, key: str, prompt, **fields) -> dict:
    r = httpx.post(f"{url}/v1/cache/explain", headers=_auth(key), timeout=120,
                   json={"model": MODEL, "prompt": prompt, **fields})
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _read_loop(ask, known: str, rounds: int = 12) -> tuple[str, list[dict]]:
    """The reported attack: ask about what is known followed by a wrong continuation, append
    the cached text the report gives to what is known, ask again. What it ends up knowing, and
    every report it got."""
    reports = []
    for _ in range(rounds):
        report = ask(known + FILLER)
        reports.append(report)
        cached = (report.get("first_miss") or {}).get("cached_text")
        if not cached:
            break
        known += cached
    return known, reports


def _assert_learned_nothing(guess: str, reports: list[dict]) -> None:
    """No text in any report that the prober did not send, no salt reason, and so no
    secret."""
    for report in reports:
        miss = report["first_miss"]
        assert "cached_text" not in miss and miss["reason"] != "salt", report
        for field in ("text_before", "prompt_text"):
            assert miss.get(field, "") in PUBLIC + guess + FILLER, (field, report)
        for piece in SECRET_PIECES:
            assert piece not in json.dumps(report), (piece, report)
    assert not any(piece in guess for piece in SECRET_PIECES)


# ------------------------------------------------------------------------------------------
# 1. the attack, through explain and through kv_cache_report
# ------------------------------------------------------------------------------------------

def test_the_reported_attack_reads_nothing_and_the_admin_still_diagnoses(shared):
    url = shared.url
    _complete(url, ALICE, PUBLIC + SECRET)

    def explain_as(key):
        return lambda guess: _explain(url, key, PUBLIC + guess)

    def report_as(key):
        return lambda guess: _complete(url, key, PUBLIC + guess,
                                       kv_cache_report=True)["kv_cache_report"]

    guess, reports = _read_loop(explain_as(MALLORY), GUESS)
    assert reports[0]["cached_tokens"] > 0  # the public prefix is shared, as at every peer
    assert reports[0]["first_miss"]["reason"] == "diverged"  # a position, and no text
    _assert_learned_nothing(guess, reports)
    # The admin keeps the full diagnosis: the same loop reads the cached continuation (so the
    # loop could have failed above). Explain changes nothing, so Mallory's probes left the
    # cache as Alice did.
    read, reports = _read_loop(explain_as(ADMIN), GUESS, rounds=3)
    assert reports[0]["first_miss"]["cached_text"].startswith("1029"), reports[0]
    assert "1029" in read
    # ... and through real requests' reports (which do cache what they send)
    guess, reports = _read_loop(report_as(MALLORY), GUESS)
    _assert_learned_nothing(guess, reports)
    report = _complete(url, ADMIN, PUBLIC + GUESS + "7777 wanted a loan",
                       kv_cache_report=True)["kv_cache_report"]
    assert report["first_miss"]["cached_text"], report


def test_the_salt_probe_answers_as_for_a_prompt_never_seen(shared):
    """The first caller's exact prompt under the prober's own salt, against token ids of the
    same length nobody sent: the two answers are equal, field for field."""
    from kvserve.tokenizer.tokenizer import Tokenizer

    url = shared.url
    secret = PUBLIC + " The salted record: vault code 9911-2045." + SECRET
    ids = Tokenizer.from_dir(ensure_default_model()).encode(secret)
    out = _complete(url, ALICE, ids, cache_salt="alice-salt", kv_cache_report=True)
    assert out["kv_cache_report"]["prompt_tokens"] == len(ids) > 64
    assert _explain(url, ALICE, ids, cache_salt="alice-salt")["cached_tokens"] >= 48
    never = [3 + (t * 31 + 17) % 997 for t in ids]
    assert not set(zip(never, never[1:])) & set(zip(ids, ids[1:]))
    probe = _explain(url, MALLORY, ids, cache_salt="mallory-salt")
    assert probe == _explain(url, MALLORY, never, cache_salt="mallory-salt")
    assert probe["first_miss"]["reason"] == "never_seen" and probe["cached_tokens"] == 0
    report = _complete(url, MALLORY, ids, cache_salt="mallory-salt2",
                       kv_cache_report=True)["kv_cache_report"]
    assert report["first_miss"]["reason"] == "never_seen" and report["cached_tokens"] == 0
    # the admin is told where the tokens are (the salt reason), not whose they are
    admin = _explain(url, ADMIN, ids, cache_salt="admin-salt")
    assert admin["first_miss"] == {"position": 0, "reason": "salt",
                                   "cached_under_other_salt": True}


# ------------------------------------------------------------------------------------------
# 2. routes x credentials
# ------------------------------------------------------------------------------------------

# route -> expected status for: no key, a wrong key, an ordinary key, the admin key
MATRIX = {
    ("POST", "/reset_prefix_cache"): (401, 401, 403, 200),
    ("GET", "/v1/kv_events"): (401, 401, 403, 200),
    ("GET", "/v1/cache/pins"): (401, 401, 200, 200),
    ("POST", "/v1/cache/explain"): (401, 401, 200, 200),
    ("POST", "/v1/completions"): (401, 401, 200, 200),
    ("GET", "/v1/models"): (401, 401, 200, 200),
    ("GET", "/health"): (200, 200, 200, 200),
    ("GET", "/metrics"): (200, 200, 200, 200),
    ("GET", "/version"): (200, 200, 200, 200),
}
BODIES = {"/v1/cache/explain": {"model": MODEL, "prompt": "hello there"},
          "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 1}}


@pytest.mark.parametrize("route", list(MATRIX), ids=lambda r: f"{r[0]} {r[1]}")
def test_routes_by_credential(shared, route):
    method, path = route
    for key, want in zip((None, "sk-wrong", MALLORY, ADMIN), MATRIX[route]):
        r = httpx.request(method, shared.url + path, headers=_auth(key), timeout=120,
                          json=BODIES.get(path) if method == "POST" else None)
        if want == 200:
            assert r.status_code == 200, (path, key, r.text[:300])
            continue
        err = _assert_error_shape(r, want)
        if want == 401:
            assert err["code"] == "invalid_api_key"
        else:
            assert err["code"] == "insufficient_permissions" and "admin" in err["message"]


def test_the_openai_client_sees_a_permission_error(shared):
    client = openai.OpenAI(base_url=f"{shared.url}/v1", api_key=MALLORY, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.get("/kv_events", cast_to=object)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage


def test_pins_are_their_callers_own(shared):
    url = shared.url
    prompt = PUBLIC + " Pinned for Alice alone."
    r = httpx.post(f"{url}/v1/cache/pin", headers=_auth(ALICE), timeout=120,
                   json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text[:300]
    pin = r.json()

    def listed(key):
        return [p["id"] for p in httpx.get(f"{url}/v1/cache/pins", headers=_auth(key),
                                           timeout=30).json()["data"]]
    try:
        assert pin["id"] in listed(ALICE) and pin["id"] in listed(ADMIN)
        assert pin["id"] not in listed(MALLORY)
        # another caller's pin answers as an unknown one does
        gone = httpx.delete(f"{url}/v1/cache/pin/{pin['id']}", headers=_auth(MALLORY))
        unknown = httpx.delete(f"{url}/v1/cache/pin/pin-999999", headers=_auth(MALLORY))
        assert gone.status_code == unknown.status_code == 404
        assert _assert_error_shape(gone, 404)["message"].replace(pin["id"], "X") == \
            _assert_error_shape(unknown, 404)["message"].replace("pin-999999", "X")
        assert pin["id"] in listed(ALICE)
        # the admin may release anyone's
        assert httpx.delete(f"{url}/v1/cache/pin/{pin['id']}",
                            headers=_auth(ADMIN)).status_code == 200
        assert pin["id"] not in listed(ALICE)
    finally:
        httpx.delete(f"{url}/v1/cache/pin/{pin['id']}", headers=_auth(ADMIN))


# ------------------------------------------------------------------------------------------
# 3. --kv-isolation api_key
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """--kv-isolation api_key, one key by flag and one from a key file, quotas on."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# tenants\n\n  sk-bob  \n")
    log = key_file.parent / "requests.jsonl"
    srv = _server("tenancy-isolated", tmp_path_factory, "--kv-isolation", "api_key",
                  "--api-key", ALICE, "--api-key-file", str(key_file), "--admin-api-key", ADMIN,
                  "--kv-tenant-quota", "0.9", "--request-log", str(log))
    srv.request_log = log
    yield srv
    srv.stop()


def _hits(url: str) -> float:
    """The server's prefix-cache hit counter (tokens)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvserve:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvserve:prefix_cache_hits_total")


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_key_gets_nothing_of_the_first_keys_cache(isolated):
    url = isolated.url
    prompt = PUBLIC * 4 + " Shared words, separate caches."
    first = _complete(url, ALICE, prompt)
    assert _cached(first) == 0 and first["usage"]["prompt_tokens"] > 128
    assert _cached(_complete(url, ALICE, prompt)) >= 128  # a key's own repeat hits
    before = _hits(url)
    bob = _complete(url, "sk-bob", prompt, kv_cache_report=True)
    assert _cached(bob) == 0 and bob["kv_cache_report"]["cached_tokens"] == 0
    assert bob["kv_cache_report"]["first_miss"]["reason"] == "never_seen"
    assert _hits(url) == before  # every prompt token computed: a cold prefill
    assert _cached(_complete(url, "sk-bob", prompt)) >= 128  # then Bob's own repeat hits
    # a salt still subdivides within a key
    assert _cached(_complete(url, ALICE, prompt, cache_salt="project-x")) == 0
    assert _cached(_complete(url, ALICE, prompt, cache_salt="project-x")) >= 128
    # explain answers in the caller's namespace; the admin's full view names the salt reason
    assert _explain(url, "sk-bob", prompt)["cached_tokens"] >= 128
    admin = _explain(url, ADMIN, prompt)
    assert admin["cached_tokens"] == 0 and admin["first_miss"]["reason"] == "salt"
    # quotas follow the key: Alice's two salts are one tenant (a label per tenant), in the
    # admin's scrape only: an ordinary scrape stays aggregate
    def tenants(key):
        return [line for line in httpx.get(f"{url}/metrics", headers=_auth(key)).text.splitlines()
                if line.startswith("kvserve:kv_tenant_idle_cached_blocks{")]
    assert len(tenants(ADMIN)) == 2, tenants(ADMIN)
    assert tenants(None) == tenants(ALICE) == []


def test_the_request_log_keeps_the_namespaces_for_diagnose(isolated):
    """kvserve diagnose replays a log by namespace: under api_key two keys' identical prompts
    are apart in the replay as they were in the cache (the log has the namespace, a digest of
    the key, never the key)."""
    from kvserve.diagnose.log import parse_line

    prompt = "Logged words for two tenants, " * 8
    for key in (ALICE, "sk-bob"):
        _complete(isolated.url, key, prompt, cache_salt="same-salt")
    lines = [json.loads(line) for line in isolated.request_log.read_text().splitlines()]
    ours = [d for d in lines if d.get("prompt") == prompt]
    assert len(ours) == 2 and all(d["cache_salt"] == "same-salt" for d in ours)
    spaces = [parse_line(d, i, "log")[0].cache_salt for i, d in enumerate(ours)]
    assert len(set(spaces)) == 2 and all(s.startswith("key:") for s in spaces)
    assert ALICE not in isolated.request_log.read_text()


def test_the_gateways_keys_under_api_key_are_that_keys_block_hashes(isolated):
    """What `kvserve route --kv-isolation api_key` routes by: a key's prefix keys are the
    hashes the replica stored for that key's request, and no other key's."""
    from kvserve.router.keys import PrefixKeyer

    url = isolated.url
    ids = [7 + (i * 13) % 1000 for i in range(80)]
    _complete(url, "sk-bob", ids)
    r = httpx.get(f"{url}/v1/kv_events", params={"since": -1}, headers=_auth(ADMIN))
    stored = {h for e in r.json()["events"] if e["type"] == "BlockStored"
              for h in e["block_hashes"]}
    keyer = PrefixKeyer(16, None, "api_key")
    bob = keyer.keys("/v1/completions", {"prompt": ids}, "sk-bob")
    assert len(bob) == 5 and set(bob[:4]) <= stored
    assert not set(keyer.keys("/v1/completions", {"prompt": ids}, ALICE)) & stored
    assert not set(PrefixKeyer(16).keys("/v1/completions", {"prompt": ids})) & stored


# ------------------------------------------------------------------------------------------
# 4. start-up: addresses and flags
# ------------------------------------------------------------------------------------------

def test_no_admin_endpoint_without_a_key_off_loopback(tmp_path_factory):
    srv = _server("tenancy-open", tmp_path_factory, "--host", "0.0.0.0")
    try:
        err = _assert_error_shape(httpx.post(f"{srv.url}/reset_prefix_cache"), 403)
        assert "--admin-api-key" in err["message"]
        _assert_error_shape(httpx.get(f"{srv.url}/v1/kv_events"), 403)
        _complete(srv.url, None, PUBLIC + SECRET)
        report = _explain(srv.url, None, PUBLIC + GUESS + "5550")
        assert report["cached_tokens"] > 0 and "cached_text" not in report["first_miss"]
        assert "admin endpoints: off" in srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("flags,message", [
    (["--kv-isolation", "api_key"], "--api-key"),
    (["--kv-tenant-by", "api_key"], "--api-key"),
    (["--api-key-protect-all"], "--api-key"),
    (["--api-key-file", "/nonexistent/keys.txt"], "--api-key-file"),
])
def test_flags_that_cannot_work_fail_at_start(flags, message):
    r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "1", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_roles_by_keys_and_flags_not_by_address():
    """A keyless server has no admin, whatever address it binds (a reverse proxy on the same
    host makes every remote user a loopback peer); only the flag makes every caller one."""
    none = Credentials()
    assert not AccessPolicy.build(none).caller(None).admin
    assert not AccessPolicy().caller(None).admin  # build_app's default too
    assert "--allow-unauthenticated-admin opens them" in AccessPolicy.build(none).describe_admin()
    open_ = AccessPolicy.build(none, allow_unauthenticated_admin=True)
    assert open_.caller(None).admin and "open to every caller" in open_.describe_admin()
    keys = Credentials.of(["sk-u"], ["sk-a"])
    policy = AccessPolicy.build(keys)
    assert policy.caller(None) is None and policy.caller("Bearer sk-x") is None
    assert not policy.caller("Bearer sk-u").admin and policy.caller("bearer sk-a").admin
    # keys without an admin key: no admin, even on loopback, unless the flag says so
    users = AccessPolicy.build(Credentials.of(["sk-u"]))
    assert not users.caller("Bearer sk-u").admin
    assert AccessPolicy.build(Credentials.of(["sk-u"]),
                              allow_unauthenticated_admin=True).caller("Bearer sk-u").admin
    assert AccessPolicy.build(keys, kv_isolation="api_key").tenant_by == "api_key"
    with pytest.raises(ValueError):
        Credentials.of([" spaced "])


def test_namespaces_are_apart_and_bounded(tmp_path):
    a, b = key_digest("sk-a"), key_digest("sk-b")
    assert cache_namespace("none", "s", a) is None
    assert cache_namespace("cache_salt", "s", a) == "s"
    spaces = {cache_namespace("api_key", salt, k) for salt in (None, "s", "t") for k in (a, b)}
    assert len(spaces) == 6 and all(len(s) <= 80 for s in spaces)
    assert len(cache_namespace("api_key", "x" * 256, a)) <= 80
    (tmp_path / "k").write_text("# c\n\nk1\n k2 \n")
    assert read_key_file(tmp_path / "k") == ["k1", "k2"]
    (tmp_path / "e").write_text("# only a comment\n")
    with pytest.raises(ValueError, match="no key"):
        read_key_file(tmp_path / "e")
