"""Storage tiers under the KV pool: host memory (L2), a local disk directory and a real Redis
server (L3), against transformers as the reference.

1. Greedy outputs equal transformers' with every tier, and the hits really come from the tier
   under test (hit counters by source), so none of this passes with the tiers silently off.
2. Two engine processes share one Redis: the second gets remote hits for what the first computed.
3. Faults: Redis killed mid-run, restarted, or stalled; chunks corrupted or truncated on disk and
   in Redis; the disk budget filled; I/O errors. No request fails, outputs stay equal, and the
   fault shows in the counters and the log.
4. The chunk format itself: every single-byte corruption is caught; keys separate models,
   dtypes, layouts and tenants; concurrent writers of one key are safe.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, kv_bytes_per_token
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefix_caching import generate, make_llm

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.kv.tiers.chunk import ChunkIdentity, CorruptChunkError, decode, encode
from kvserve.kv.tiers.config import TierConfig, load_tier_config
from kvserve.kv.tiers.stats import TierStats
from kvserve.kv.tiers.stores import DiskStore, HostStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

HF_VOCAB = 512
NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
CHUNK = 32  # tokens: two 16-token blocks
KEY = b"test-kv-auth-key-" * 2  # the chunk MAC's key in the format tests
DOC, QUESTION = 150, 10  # a prompt = document + question: 4 whole chunks are loadable
POOL_TOKENS = 192  # 12 blocks: one request at a time, each evicting the one before


@pytest.fixture(scope="module")
def workload(hf_checkpoints):
    """Three documents with two questions each; pass A asks the first questions (each request
    evicts the previous document from the pool), pass B the second ones (the documents must
    come back from a tier). Plus transformers' greedy continuations of all six prompts."""
    rng = random.Random(11)
    docs = [[rng.randrange(3, HF_VOCAB) for _ in range(DOC)] for _ in range(3)]
    questions = [[[rng.randrange(3, HF_VOCAB) for _ in range(QUESTION)] for _ in range(2)]
                 for _ in range(3)]
    pass_a = [d + q[0] for d, q in zip(docs, questions)]
    pass_b = [d + q[1] for d, q in zip(docs, questions)]
    path = hf_checkpoints["qwen3"]
    return path, pass_a, pass_b, hf_greedy(path, pass_a, NEW), hf_greedy(path, pass_b, NEW)


def tier_llm(path, tiers: dict, pool_tokens: int = POOL_TOKENS, **kwargs):
    return make_llm(path, pool_tokens=pool_tokens, block_size=16, max_model_len=512,
                    kv_tier_config={"chunk_size": CHUNK, **tiers}, **kwargs)


def tokens_of(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run_passes(llm, workload):
    """Pass A, wait for its saves, then pass B; both checked against transformers."""
    _, pass_a, pass_b, want_a, want_b = workload
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a
    assert llm.engine.tiers.flush()
    outs_b = generate(llm, pass_b, PARAMS)
    assert tokens_of(outs_b) == want_b
    return outs_b


@pytest.fixture
def log_records():
    """Warnings of the tier code (the kvserve loggers may not propagate to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("kvserve.tiers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def tiers_for(kind: str, tmp_path, request) -> dict:
    if kind == "host":
        return {"local_cpu": True, "max_local_cpu_size": 0.01}
    if kind == "disk":
        return {"local_cpu": False, "local_disk": str(tmp_path / "disk"),
                "max_local_disk_size": 0.01}
    server = request.getfixturevalue("redis_server")
    if kind == "remote":
        return {"local_cpu": False, "remote_url": server.url}
    if kind == "remote-zlib":
        return {"local_cpu": False, "remote_url": server.url, "remote_serde": "zlib"}
    raise ValueError(kind)


# -- 1. outputs equal transformers, loads from every tier -------------------------------------
@pytest.mark.parametrize("kind", ["host", "disk", "remote", "remote-zlib"])
def test_loads_from_each_tier_match_transformers(workload, kind, tmp_path, request):
    source = "remote" if kind.startswith("remote") else kind
    llm = tier_llm(workload[0], tiers_for(kind, tmp_path, request))
    run_passes(llm, workload)
    stats = llm.engine.stats()
    # the first two documents were evicted by pass A and come back whole: 4 chunks each
    assert stats.hit_tokens[source] >= 2 * 4 * CHUNK, stats
    tier = llm.engine.tier_stats()
    assert tier["bytes_loaded"].get(source, 0) > 0 and not tier["errors"], tier
    llm.engine.shutdown()


def test_write_through_serves_after_a_reset(workload, tmp_path):
    """Write-through saves chunks as they are computed: after the device cache and host memory
    are wiped, every document comes back from disk."""
    llm = tier_llm(workload[0], {"local_cpu": True, "local_disk": str(tmp_path),
                                 "max_local_disk_size": 0.01, "write_policy": "write_through"},
                   pool_tokens=4096)
    _, pass_a, pass_b, want_a, want_b = workload
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a
    assert llm.engine.stats().num_evicted_blocks == 0  # nothing was saved by eviction
    llm.engine.tiers.flush()
    llm.reset_prefix_cache()
    llm.engine.tiers.clear(["host"])
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    assert llm.engine.stats().hit_tokens["disk"] == 3 * 4 * CHUNK


def test_tiers_off_and_on_agree_on_a_mixed_workload(workload, tmp_path):
    """Many prompts sharing documents, interleaved, with preemptions: identical to no tiers,
    and both to transformers."""
    path, pass_a, pass_b, *_ = workload
    rng = random.Random(5)
    prompts = [rng.choice(pass_a + pass_b)[: rng.randrange(40, DOC + QUESTION)] + [7, 8, 9]
               for _ in range(12)]
    plain = tokens_of(generate(make_llm(path, pool_tokens=POOL_TOKENS, block_size=16,
                                        max_model_len=512), prompts, PARAMS))
    assert plain == hf_greedy(path, prompts, NEW)
    llm = tier_llm(path, {"local_cpu": True, "max_local_cpu_size": 0.01,
                          "local_disk": str(tmp_path), "max_local_disk_size": 0.01})
    assert tokens_of(generate(llm, prompts, PARAMS)) == plain
    assert tokens_of(generate(llm, prompts[::-1], PARAMS)) == plain[::-1]
    assert llm.engine.stats().hit_tokens["host"] > 0


def test_tenants_and_models_do_not_share_chunks(workload, tmp_path, hf_checkpoints):
    path, pass_a, pass_b, want_a, want_b = workload
    disk = {"local_cpu": False, "local_disk": str(tmp_path), "max_local_disk_size": 0.01}
    llm = tier_llm(path, disk)
    generate(llm, [{"prompt_token_ids": p, "cache_salt": "tenant-a"} for p in pass_a], PARAMS)
    llm.engine.tiers.flush()
    outs = generate(llm, [{"prompt_token_ids": p, "cache_salt": "tenant-b"} for p in pass_b],
                    PARAMS)
    assert tokens_of(outs) == want_b
    assert llm.engine.stats().hit_tokens["disk"] == 0  # other tenant: no hit
    # another model (same shapes, other weights) on the same directory: no hit either
    other = tier_llm(hf_checkpoints["qwen2"], disk)
    generate(other, pass_a, PARAMS)
    assert other.engine.stats().hit_tokens["disk"] == 0
    llm.engine.shutdown()
    other.engine.shutdown()


# -- 2. two engine processes, one Redis -------------------------------------------------------
def run_worker(path, tier_config: dict, prompts) -> dict:
    worker = Path(__file__).with_name("tier_worker.py")
    pool = POOL_TOKENS * kv_bytes_per_token(path)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    done = subprocess.run([sys.executable, str(worker), str(path), json.dumps(tier_config),
                           json.dumps(prompts), str(pool)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_redis(workload, redis_server):
    path, pass_a, pass_b, want_a, want_b = workload
    config = {"chunk_size": CHUNK, "local_cpu": True, "remote_url": redis_server.url,
              "write_policy": "write_through"}
    first = run_worker(path, config, pass_a)
    assert first["tokens"] == want_a and first["stats"]["hit_tokens"]["remote"] == 0
    assert first["tiers"]["bytes_saved"]["remote"] > 0
    second = run_worker(path, config, pass_b)
    assert second["tokens"] == want_b
    assert second["stats"]["hit_tokens"]["remote"] == 3 * 4 * CHUNK, second["stats"]


# -- 3. faults --------------------------------------------------------------------------------
def test_redis_killed_mid_run_then_restarted(workload, redis_server, log_records):
    path, pass_a, pass_b, want_a, want_b = workload
    llm = tier_llm(path, {"local_cpu": False, "remote_url": redis_server.url,
                          "remote_timeout": 0.2, "remote_retry_interval": 0.1})
    engine = llm.engine
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a
    engine.tiers.flush()
    # pass B, with the server killed after the first step
    ids = [engine.add_request({"prompt_token_ids": p}, PARAMS) for p in pass_b]
    engine.step()
    redis_server.kill()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == want_b
    errors = engine.tier_stats()["errors"]
    assert sum(n for k, n in errors.items() if k.startswith("remote:")) > 0, errors
    assert any("unreachable" in r.getMessage() for r in log_records)
    # back up (empty, no persistence): saves and hits resume after the retry interval
    redis_server.restart()
    time.sleep(0.2)
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a
    engine.tiers.flush()
    before = engine.stats().hit_tokens["remote"]
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    assert engine.stats().hit_tokens["remote"] > before
    assert any("is back" in r.getMessage() for r in log_records)
    engine.shutdown()


def test_stalled_redis_costs_a_miss_not_a_stall(workload, redis_server):
    """DEBUG SLEEP freezes the server: every call times out; steps stay short."""
    path, pass_a, pass_b, want_a, want_b = workload
    llm = tier_llm(path, {"local_cpu": False, "remote_url": redis_server.url,
                          "remote_timeout": 0.2, "remote_retry_interval": 5.0,
                          "prefetch_timeout": 0.5})
    engine = llm.engine
    generate(llm, pass_a, PARAMS)
    engine.tiers.flush()
    sleeper = threading.Thread(target=lambda: redis_server.client().execute_command(
        "DEBUG", "SLEEP", "4"))
    sleeper.start()
    time.sleep(0.2)
    ids = [engine.add_request({"prompt_token_ids": p}, PARAMS) for p in pass_b]
    done, longest = {}, 0.0
    while engine.has_unfinished_requests():
        start = time.monotonic()
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        longest = max(longest, time.monotonic() - start)
    finished_while_stalled = sleeper.is_alive()
    sleeper.join()
    assert [done[i] for i in ids] == want_b
    assert finished_while_stalled, "the engine waited for the stalled server"
    assert longest < 2.0, f"a step took {longest:.2f} s"
    assert engine.stats().hit_tokens["remote"] == 0
    assert engine.tier_stats()["errors"].get("remote:TimeoutError", 0) >= 1
    engine.shutdown()


def corrupt(blob: bytes, how: str) -> bytes:
    if how == "truncate":
        return blob[: len(blob) // 2]
    middle = len(blob) // 2
    return blob[:middle] + bytes([blob[middle] ^ 0xFF]) + blob[middle + 1:]


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_chunks_on_disk_are_dropped_and_recomputed(workload, tmp_path, how, log_records):
    disk = tmp_path / "disk"
    llm = tier_llm(workload[0], {"local_cpu": False, "local_disk": str(disk),
                                 "max_local_disk_size": 0.01})
    _, pass_a, pass_b, want_a, want_b = workload
    generate(llm, pass_a, PARAMS)
    llm.engine.tiers.flush()
    files = sorted(disk.glob("*.kvchunk"))
    assert files
    for f in files:
        f.write_bytes(corrupt(f.read_bytes(), how))
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    stats, tier = llm.engine.stats(), llm.engine.tier_stats()
    assert stats.hit_tokens["disk"] == 0
    assert tier["errors"].get("disk:corrupt_chunk", 0) >= 2
    assert any("dropping a bad KV chunk" in r.getMessage() for r in log_records)
    # the bad chunks that were read are gone; the recomputed ones are saved again and serve
    llm.engine.tiers.flush()
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    assert llm.engine.stats().hit_tokens["disk"] > 0


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_chunks_in_redis_are_dropped_and_recomputed(workload, redis_server, how):
    llm = tier_llm(workload[0], {"local_cpu": False, "remote_url": redis_server.url})
    _, pass_a, pass_b, want_a, want_b = workload
    generate(llm, pass_a, PARAMS)
    llm.engine.tiers.flush()
    client = redis_server.client()
    keys = client.keys("kvserve:*")
    assert keys
    for key in keys:
        client.set(key, corrupt(client.get(key), how))
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    assert llm.engine.stats().hit_tokens["remote"] == 0
    assert llm.engine.tier_stats()["errors"].get("remote:corrupt_chunk", 0) >= 2
    llm.engine.tiers.flush()  # recomputed chunks replace the dropped ones, and serve
    assert tokens_of(generate(llm, pass_b, PARAMS)) == want_b
    assert llm.engine.stats().hit_tokens["remote"] > 0
    llm.engine.shutdown()


def test_disk_budget_filled(workload, tmp_path):
    """A budget of 2.5 chunks: older chunks are evicted, too-big saves skipped, nothing fails."""
    path = workload[0]
    chunk_bytes = CHUNK * kv_bytes_per_token(path)
    budget_gb = 2.5 * chunk_bytes / 1024**3
    disk = tmp_path / "disk"
    llm = tier_llm(path, {"local_cpu": False, "local_disk": str(disk),
                          "max_local_disk_size": budget_gb})
    run_passes(llm, workload)
    files = list(disk.glob("*.kvchunk"))
    assert 1 <= len(files) <= 2
    assert sum(f.stat().st_size for f in files) <= budget_gb * 1024**3
    assert llm.engine.tiers.disk.used_bytes == sum(f.stat().st_size for f in files)


def test_disk_write_errors_are_skipped(workload, tmp_path, monkeypatch, log_records):
    """A full disk (ENOSPC on rename) and a vanished directory: saves are skipped and counted."""
    disk = tmp_path / "disk"
    llm = tier_llm(workload[0], {"local_cpu": False, "local_disk": str(disk),
                                 "max_local_disk_size": 0.01})

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvserve.kv.tiers.stores.os.replace", full_disk)
    run_passes(llm, workload)
    tier = llm.engine.tier_stats()
    assert tier["errors"].get("disk:write_error", 0) >= 2
    assert tier["skipped_saves"].get("disk_error", 0) >= 2
    assert not list(disk.glob("*")), "a temporary file was left behind"
    assert any("No space left" in r.getMessage() for r in log_records)


# -- 4. the chunk format and the stores -------------------------------------------------------
IDENTITY = ChunkIdentity("m", torch.float32, 2, 2, 4, 16, 32)


def chunk_tensor(identity=IDENTITY, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(identity.shape, generator=g).to(identity.dtype)


@pytest.mark.parametrize("serde", ["naive", "zlib"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunks_round_trip(serde, dtype):
    identity = ChunkIdentity("m", dtype, 2, 2, 4, 16, 32)
    data = chunk_tensor(identity)
    key = identity.key(123)
    back = decode(key, encode(key, data, serde, auth_key=KEY), dtype, identity.shape,
                  auth_key=KEY)
    assert back.dtype == dtype and torch.equal(back, data)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_byte_corruption_is_caught(data):
    serde = data.draw(st.sampled_from(["naive", "zlib"]))
    key = IDENTITY.key(7)
    blob = encode(key, chunk_tensor(), serde, auth_key=KEY)
    at = data.draw(st.integers(0, len(blob) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = blob[:at] + bytes([blob[at] ^ flip]) + blob[at + 1:]
    with pytest.raises(CorruptChunkError):
        decode(key, bad, IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptChunkError):
        decode(key, blob[:cut], IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)


def test_a_chunk_under_the_wrong_key_or_shape_is_refused():
    blob = encode(IDENTITY.key(1), chunk_tensor(), auth_key=KEY)
    with pytest.raises(CorruptChunkError, match="another key"):
        decode(IDENTITY.key(2), blob, IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)
    with pytest.raises(CorruptChunkError, match="expected"):
        decode(IDENTITY.key(1), blob, torch.bfloat16, IDENTITY.shape, auth_key=KEY)


def test_keys_name_model_dtype_and_layout():
    base = IDENTITY
    variants = [ChunkIdentity("other", torch.float32, 2, 2, 4, 16, 32),
                ChunkIdentity("m", torch.bfloat16, 2, 2, 4, 16, 32),
                ChunkIdentity("m", torch.float32, 3, 2, 4, 16, 32),
                ChunkIdentity("m", torch.float32, 2, 2, 4, 8, 32),
                ChunkIdentity("m", torch.float32, 2, 2, 4, 16, 64)]
    keys = {base.key(5)} | {v.key(5) for v in variants}
    assert len(keys) == 1 + len(variants)


def test_host_store_is_lru_within_its_budget():
    stats = TierStats()
    t = chunk_tensor()
    host = HostStore(int(2.5 * t.nbytes), stats)
    for k in "abc":
        assert host.put(k, t)
    assert not host.contains("a") and host.contains("b") and host.contains("c")
    host.get("b")  # b is now the most recent: d evicts c
    host.put("d", t)
    assert host.contains("b") and not host.contains("c")
    assert host.used_bytes == 2 * t.nbytes
    assert not HostStore(10, stats).put("big", t)
    assert stats.skipped_saves["host_budget"] == 1


def test_disk_store_survives_restart_and_finds_others_files(tmp_path):
    stats = TierStats()
    blob = encode(IDENTITY.key(1), chunk_tensor(), auth_key=KEY)
    a = DiskStore(str(tmp_path), 10 * len(blob), stats)
    assert a.put("k1", blob) and a.put("k2", blob)
    b = DiskStore(str(tmp_path), 10 * len(blob), stats)  # a restart: the index is rebuilt
    assert b.used_bytes == 2 * len(blob) and b.get("k1") == blob
    a.put("k3", blob)  # written by "another engine"
    assert b.get("k3") == blob and b.used_bytes == 3 * len(blob)


def _write_same_key(directory: str, blob: bytes, rounds: int) -> None:
    store = DiskStore(directory, 100 * len(blob), TierStats())
    for _ in range(rounds):
        store.delete("shared")
        store.put("shared", blob)


def test_concurrent_writers_of_one_key_are_safe(tmp_path):
    """Two processes and a thread rewriting one key at once: every read sees a whole chunk."""
    import multiprocessing

    key = IDENTITY.key(9)
    data = chunk_tensor()
    blob = encode(key, data, auth_key=KEY)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_same_key, args=(str(tmp_path), blob, 200))
             for _ in range(2)]
    for p in procs:
        p.start()
    reader = DiskStore(str(tmp_path), 100 * len(blob), TierStats())
    seen = 0
    while any(p.is_alive() for p in procs):
        got = reader.get("shared")
        if got is not None:
            back = decode(key, got, IDENTITY.dtype, IDENTITY.shape, auth_key=KEY)
            assert torch.equal(back, data)
            seen += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert seen > 0
    assert not list(tmp_path.glob("*.tmp"))


# -- configuration ----------------------------------------------------------------------------
def test_lmcache_style_yaml(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 5.0\n"
                    f"local_disk: file://{tmp_path}/cache/\nmax_local_disk_size: 20\n"
                    "remote_url: redis://localhost:6379/0\nremote_serde: zlib\n")
    config = load_tier_config(str(path))
    assert config == TierConfig(chunk_size=256, local_cpu=True, max_local_cpu_size=5.0,
                                local_disk=f"{tmp_path}/cache", max_local_disk_size=20,
                                remote_url="redis://localhost:6379/0", remote_serde="zlib")
    assert EngineConfig(kv_tier_config=str(path)).kv_tier_config == config
    assert load_tier_config('{"chunk_size": 64}').chunk_size == 64


@pytest.mark.parametrize("bad, message", [
    ({"chunk_sise": 256}, "unknown kv tier config key"),
    ({"remote_url": "http://x"}, "redis://"),
    ({"remote_serde": "cachegen"}, "remote_serde"),
    ({"local_disk": "/tmp/x"}, "max_local_disk_size"),
    ({"max_local_cpu_size": -1}, "non-negative"),
    ({"chunk_size": 0}, "positive"),
    ({"write_policy": "sometimes"}, "write_policy"),
])
def test_bad_tier_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        load_tier_config(bad)


def test_engine_checks_chunk_size_against_block_size():
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(block_size=16, kv_tier_config={"chunk_size": 40})
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(enable_prefix_caching=False, kv_tier_config={})


def test_prometheus_metrics_by_source(workload, tmp_path):
    """The server's /metrics exposition carries hits by source, bytes moved, load latency,
    faults and usage of each tier."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.server.metrics import PrometheusStatLogger

    llm = tier_llm(workload[0], {"local_cpu": False, "local_disk": str(tmp_path),
                                 "max_local_disk_size": 0.01})
    exporter = PrometheusStatLogger("m")
    run_passes(llm, workload)
    exporter.on_idle(llm.engine.step_stats())
    exporter.on_idle(llm.engine.step_stats())  # a second poll adds nothing twice
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(exporter.render().decode())
               for s in fam.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]

    stats, tier = llm.engine.stats(), llm.engine.tier_stats()
    assert value("kvserve:prefix_cache_hits_by_source_total", source="disk") \
        == stats.hit_tokens["disk"] > 0
    assert value("kvserve:kv_tier_bytes_loaded_total", tier="disk") == tier["bytes_loaded"]["disk"]
    assert value("kvserve:kv_tier_bytes_saved_total", tier="disk") == tier["bytes_saved"]["disk"]
    assert value("kvserve:kv_tier_load_latency_seconds_count", tier="disk") >= 8
    assert value("kvserve:kv_tier_usage_bytes", tier="disk") == llm.engine.tiers.disk.used_bytes


def test_cli_takes_a_tier_config_file(tmp_path):
    import argparse

    from kvserve.entrypoints.cli import add_engine_args, engine_kwargs

    path = tmp_path / "tiers.yaml"
    path.write_text("chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-tier-config", str(path)]))
    assert EngineConfig(**kwargs).kv_tier_config.chunk_size == 64


def test_a_prefix_longer_than_host_memory_loads_what_fits(workload, tmp_path):
    """Host memory of 2.5 chunks under a 4-chunk document: the prefetch stops at 2 chunks
    instead of evicting its own first chunks, and those 2 are hits."""
    path, pass_a, pass_b, want_a, want_b = workload
    budget_gb = 2.5 * CHUNK * kv_bytes_per_token(path) / 1024**3
    llm = tier_llm(path, {"local_cpu": True, "max_local_cpu_size": budget_gb,
                          "local_disk": str(tmp_path), "max_local_disk_size": 0.01})
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a
    llm.engine.tiers.flush()
    llm.reset_prefix_cache()
    llm.engine.tiers.clear(["host"])
    assert tokens_of(generate(llm, pass_b[:1], PARAMS)) == want_b[:1]
    assert llm.engine.stats().hit_tokens["disk"] == 2 * CHUNK


def test_a_failed_step_does_not_leave_unloaded_blocks_in_the_cache(workload):
    """A step fails after admitting a request whose chunks load from host memory, before the
    runner wrote them: generate() aborts the request. Its loaded blocks are in the prefix index
    already, so the load must still land (not be dropped with the request): the next request
    for the same document hits them on the device and must decode transformers' tokens."""
    path, pass_a, pass_b, want_a, want_b = workload
    llm = tier_llm(path, {"local_cpu": True, "max_local_cpu_size": 0.01})
    assert tokens_of(generate(llm, pass_a, PARAMS)) == want_a  # documents 0 and 1 go to host
    runner = llm.engine.runner
    forward = runner.forward

    def fail_once(seqs):  # after the step's plan has run
        runner.forward = forward
        raise RuntimeError("injected step failure")

    runner.forward = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([{"prompt_token_ids": pass_b[0]}], PARAMS, use_tqdm=False)
    assert llm.engine.stats().hit_tokens["host"] == 4 * CHUNK  # it was admitted with the loads
    device_before = llm.engine.stats().hit_tokens["device"]
    assert tokens_of(generate(llm, pass_b[:1], PARAMS)) == want_b[:1]
    assert llm.engine.stats().hit_tokens["device"] - device_before == 4 * CHUNK  # those blocks
    llm.engine.shutdown()


def test_two_server_replicas_share_redis(tmp_path, redis_server):
    """Two `kvserve serve` processes (--kv-tier-config) behind one Redis, driven with the
    official openai client: the second replica answers a prompt the first one computed with
    its prefix loaded from Redis (cached_tokens, /metrics by source), with the same text."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from test_server import ServerProcess, _unique_text

    config = json.dumps({"chunk_size": 32, "local_cpu": True, "max_local_cpu_size": 0.1,
                         "remote_url": redis_server.url, "write_policy": "write_through"})
    from kvserve.model_loader.make_model import ensure_default_model

    # the tiny random model, as before the default became SmolLM2 (its tokenizer sizes the text)
    tiny = str(ensure_default_model())
    replicas = [ServerProcess(name, [tiny, "--kv-tier-config", config, "--served-model-name",
                                     "tiny"], tmp_path) for name in ("replica-a", "replica-b")]
    try:
        for r in replicas:
            r.wait_ready()
        prompt = _unique_text(random.Random(7), 80)
        clients = [openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0,
                                 timeout=120) for r in replicas]
        first = clients[0].completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                              temperature=0)
        assert first.usage.prompt_tokens > 150
        client = redis_server.client()
        deadline = time.monotonic() + 30
        while len(client.keys("kvserve:*")) < first.usage.prompt_tokens // 32 - 1:
            assert time.monotonic() < deadline, "replica A saved nothing to Redis"
            time.sleep(0.1)
        second = clients[1].completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                               temperature=0)
        assert second.choices[0].text == first.choices[0].text
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= (first.usage.prompt_tokens - 1) // 32 * 32
        text = httpx.get(f"{replicas[1].url}/metrics", timeout=10).text
        by_source = {s.labels["source"]: s.value
                     for fam in text_string_to_metric_families(text) for s in fam.samples
                     if s.name == "kvserve:prefix_cache_hits_by_source_total"}
        assert by_source.get("remote", 0) == cached, by_source
    finally:
        codes = [r.stop() for r in replicas]
    assert codes == [None, None], replicas[1].log()[-3000:]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_failed_step_does_not_leave_a_copy_queued(hf_checkpoints, seed):
    """A step fails after admitting a request with a partial-block hit, before the runner made
    its copy-on-write copy; generate() aborts the request. The queued copy must go with it. Left
    queued, it was applied in the next step into its freed destination, by then a block of
    another request loaded from host memory (seed 1: wrong tokens), and it kept its source
    locked under idle parents, which the pool counted as available but could not evict
    (seed 2: NoFreeBlocksError at admission)."""
    rng = random.Random(seed)
    pool_blocks = rng.randint(14, 24)
    doc_d = [rng.randrange(3, 512) for _ in range(40)]
    doc_a = [rng.randrange(3, 512) for _ in range(40)]
    cut = 4 * rng.randint(1, 8) + rng.randint(1, 3) + 1  # doc_a[:cut] ends inside a block
    prompt = doc_d[:rng.randint(17, 39)] + [5, 6, 7]  # loads doc_d's evicted chunks
    path = hf_checkpoints["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = hf_greedy(path, [prompt], 4)
    llm = make_llm(path, pool_tokens=pool_blocks * 4, block_size=4, max_model_len=128,
                   kv_tier_config={"chunk_size": 8, "local_cpu": True,
                                   "max_local_cpu_size": 0.01})
    generate(llm, [doc_d, doc_a], params)
    runner = llm.engine.runner
    forward = runner.forward

    def fail_once(seqs):  # after the step's plan has run
        runner.forward = forward
        raise RuntimeError("injected step failure")

    runner.forward = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([{"prompt_token_ids": doc_a[:cut]}], params, use_tqdm=False)
    assert tokens_of(generate(llm, [prompt], params)) == want
    assert llm.engine.stats().hit_tokens["host"] > 0
    llm.engine.shutdown()
