"""Issue 63, items 1 and 2, unit by unit: a KV consumer pulls only from the producers its
configuration lists (kv/tiers/producers.py), whatever a request says, deciding before any
socket or name lookup; and a chunk is KV only when its MAC verifies under the deployment's key
(kv/tiers/auth.py, chunk.py), on disk, in Redis and from a producer. The same cases against
real server processes: tests/test_hostile_transfer.py."""

from __future__ import annotations

import socket
import stat

import pytest
import torch
from chunk_forgery import foreign_chunk, rewrite_payload

from kvserve.kv.tiers import auth
from kvserve.kv.tiers.chunk import ChunkAuthError, ChunkIdentity, CorruptChunkError, decode, \
    encode
from kvserve.kv.tiers.config import TierConfig
from kvserve.kv.tiers.producers import Producer, parse_producers, resolve_producer
from kvserve.kv.tiers.tiered import TieredKVStore
from kvserve.kv.tiers.transfer import load_transfer_config

KEY = b"unit-test-kv-auth-key-0123456789"
IDENTITY = ChunkIdentity("m", torch.float32, 2, 2, 4, 16, 16)


def _consumer(producers, **extra):
    return load_transfer_config({"kv_connector": "kvserve", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"producers": producers, **extra}})


def _pull(**params):
    return {"do_remote_prefill": True, "kv_connector": "kvserve", **params}


# -- producers: the configuration --------------------------------------------------------------
def test_producers_are_parsed_from_strings_and_objects():
    got = parse_producers(["10.0.0.5:14579", {"engine_id": "p1", "host": "pf-a", "port": 9},
                           "[::1]:7000"])
    assert got == (Producer("10.0.0.5", 14579), Producer("pf-a", 9, "p1"),
                   Producer("::1", 7000))
    assert got[2].address == "[::1]:7000"


@pytest.mark.parametrize("value, message", [
    ("10.0.0.5:1", "must be a list"),
    (["10.0.0.5"], r"producers\[0\] needs a host"),
    ([":80"], "needs a host"),
    (["h:0"], "port number"),
    (["h:99999"], "port number"),
    (["h:http"], "port number"),
    ([{"host": "h", "port": True}], "port number"),
    ([{"host": "h", "port": 1, "url": "x"}], r"unknown key\(s\) \['url'\]"),
    ([{"host": "h", "port": 1, "engine_id": ""}], "engine_id"),
    ([7], "must be \"host:port\" or an object"),
])
def test_malformed_producers_are_refused_at_start_up(value, message):
    with pytest.raises(ValueError, match=message):
        _consumer(value)


@pytest.mark.parametrize("cfg", [
    {"kv_connector": "kvserve", "kv_role": "kv_producer"},
    {"kv_connector": "redis", "kv_role": "kv_consumer"},
])
def test_producers_belong_to_a_kvserve_consumer_only(cfg):
    extra = {"producers": ["h:1"], "redis_url": "redis://h:6379/0"}
    with pytest.raises(ValueError, match="producers is for a kv_consumer"):
        load_transfer_config({**cfg, "kv_connector_extra_config": extra})


def test_a_bad_auth_key_file_is_refused_at_start_up(tmp_path):
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="needs at least 16"):
        _consumer(["h:1"], auth_key_file=str(short))
    with pytest.raises(ValueError, match="KV auth key file"):
        _consumer(["h:1"], auth_key_file=str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="KV auth key file"):
        TierConfig(auth_key_file=str(tmp_path / "missing.key"))


# -- producers: a request names one, or is refused ---------------------------------------------
def test_a_request_names_a_configured_producer_by_address_or_engine_id():
    cfg = _consumer(["127.0.0.1:7001", {"engine_id": "pf-b", "host": "10.1.1.1", "port": 7002}])
    assert cfg.peer_address(_pull(remote_host="127.0.0.1", remote_port=7001)) \
        == "127.0.0.1:7001"
    # By engine id, the configured address is dialled, not the one the request carries.
    assert cfg.peer_address(_pull(remote_engine_id="pf-b", remote_host="192.168.9.9",
                                  remote_port=22)) == "10.1.1.1:7002"
    assert cfg.peer_address(_pull(remote_engine_id="pf-b")) == "10.1.1.1:7002"
    # A producer's random engine id, with its configured address: the normal P/D answer.
    assert cfg.peer_address(_pull(remote_engine_id="0123abcd", remote_host="127.0.0.1",
                                  remote_port=7001)) == "127.0.0.1:7001"
    assert cfg.peer_address({"do_remote_decode": True}) is None
    assert cfg.peer_address(_pull(kv_connector="redis")) is None


@pytest.mark.parametrize("params", [
    _pull(remote_host="127.0.0.1", remote_port=7009),  # another port
    _pull(remote_host="localhost", remote_port=7001),  # a name for it: never resolved
    _pull(remote_host="127.0.0.2", remote_port=7001),
    _pull(remote_engine_id="nobody", remote_host="10.9.9.9", remote_port=7001),
    _pull(),
])
def test_anything_else_is_refused_without_a_connection(params, monkeypatch):
    opened = []
    for name in ("create_connection", "getaddrinfo", "gethostbyname"):
        monkeypatch.setattr(socket, name, lambda *a, _n=name, **k: opened.append(_n))
    cfg = _consumer(["127.0.0.1:7001"])
    with pytest.raises(ValueError, match="name no producer this KV consumer is configured"):
        cfg.peer_address(params)
    assert opened == []


def test_a_consumer_without_producers_refuses_every_pull_and_says_how_to_configure():
    cfg = load_transfer_config({"kv_connector": "kvserve", "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="no configured producers.*producers"):
        cfg.peer_address(_pull(remote_host="127.0.0.1", remote_port=7001))
    with pytest.raises(ValueError, match="remote_port"):
        resolve_producer((), _pull(remote_host="h", remote_port="x"))


# -- the key -----------------------------------------------------------------------------------
def test_the_default_key_is_private_created_once_and_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    key = auth.load_auth_key()
    path = tmp_path / auth.DEFAULT_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) == 64 and auth.load_auth_key() == key
    assert [p.name for p in tmp_path.iterdir()] == [auth.DEFAULT_KEY_FILE]  # no temp left


def test_a_configured_key_wins_over_the_environment_and_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(auth.ENV_VAR, "from-the-environment-0123")
    assert auth.load_auth_key() == b"from-the-environment-0123"
    f = tmp_path / "k"
    f.write_text("from-a-file-0123456789\n")
    assert auth.load_auth_key(str(f)) == b"from-a-file-0123456789"
    assert not (tmp_path / auth.DEFAULT_KEY_FILE).exists()
    monkeypatch.setenv(auth.ENV_VAR, "short")
    with pytest.raises(ValueError, match="KVSERVE_KV_AUTH_KEY"):
        auth.load_auth_key()


# -- the MAC -----------------------------------------------------------------------------------
def test_only_the_mac_catches_a_forged_payload():
    key = IDENTITY.key(3)
    data = torch.randn(IDENTITY.shape)
    blob = encode(key, data, auth_key=KEY)
    assert torch.equal(decode(key, blob, IDENTITY.dtype, IDENTITY.shape, auth_key=KEY), data)
    with pytest.raises(ChunkAuthError, match="fails its MAC"):
        decode(key, rewrite_payload(blob), IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)
    with pytest.raises(ChunkAuthError):
        decode(key, foreign_chunk(key, IDENTITY.shape, IDENTITY.dtype), IDENTITY.dtype,
               IDENTITY.shape, auth_key=KEY)
    with pytest.raises(ChunkAuthError):  # another deployment's key
        decode(key, blob, IDENTITY.dtype, IDENTITY.shape, auth_key=KEY[::-1])


def test_each_seal_has_a_fresh_nonce_and_any_changed_byte_fails_it():
    """The GMAC (auth.py): two seals of one chunk differ (a nonce reused under one key would
    give the GHASH key away) and both verify; a changed byte of any part, of the nonce or of
    the tag fails, and so does another secret."""
    parts = [b"fields", b"kvserve:abc:01", bytes(range(256)) * 64]
    a, b = auth.mac_seal(KEY, parts), auth.mac_seal(KEY, parts)
    assert a != b and a[:12] != b[:12] and len(a) == auth.MAC_BYTES
    assert auth.mac_verify(KEY, parts, a) and auth.mac_verify(KEY, parts, b)
    for i in range(len(parts)):
        changed = list(parts)
        changed[i] = bytes([changed[i][0] ^ 1]) + changed[i][1:]
        assert not auth.mac_verify(KEY, changed, a)
    for at in (0, 11, 12, auth.MAC_BYTES - 1):  # the nonce's ends, the tag's ends
        forged = bytearray(a)
        forged[at] ^= 0x80
        assert not auth.mac_verify(KEY, parts, bytes(forged))
    assert not auth.mac_verify(KEY[::-1], parts, a)
    assert not auth.mac_verify(KEY, parts, a[:-1])


def test_unauthenticated_version_1_chunks_are_not_read():
    key = IDENTITY.key(4)
    blob = bytearray(encode(key, torch.zeros(IDENTITY.shape), auth_key=KEY))
    blob[4:6] = (1).to_bytes(2, "little")
    with pytest.raises(CorruptChunkError, match="format version 1"):
        decode(key, bytes(blob), IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)


def test_a_forged_disk_chunk_is_a_counted_miss_and_is_deleted(tmp_path):
    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY)
    cfg = TierConfig(chunk_size=16, local_cpu=False, local_disk=str(tmp_path / "disk"),
                     max_local_disk_size=0.01, auth_key_file=str(key_file))
    tiers = TieredKVStore(cfg, IDENTITY)
    try:
        tiers.save(11, torch.randn(IDENTITY.shape))
        tiers.save(12, torch.randn(IDENTITY.shape))
        assert tiers.flush()
        path = tmp_path / "disk" / (tiers.key(11).replace(":", "_") + ".kvchunk")
        path.write_bytes(rewrite_payload(path.read_bytes()))
        assert tiers.prefetch([11, 12]).future.result(10) == 0  # a miss at the first chunk
        assert tiers.lookup([11, 12]) == []
        assert tiers.stats.errors[("disk", "auth_failed")] == 1
        assert tiers.load_error(11) == ("disk", "auth_failed")
        assert not path.exists()  # the recomputed chunk can take its place
        assert tiers.prefetch([12]).future.result(10) == 1  # the genuine one still loads
    finally:
        tiers.close()
