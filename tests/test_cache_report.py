"""The per-request cache report ("why did my prompt miss?", kvserve/kv/report.py).

1. A table of constructed cases, one per reason, through real server processes (a tiny model;
   a sliding-window one for `window`; a disk tier for its source and `tier_error`; an
   engine-wide SnapKV cache for `bounded`): each request's `kv_cache_report` names the reason
   the case was built for, and `POST /v1/cache/explain` said the same before the request ran
   and agrees with what it then found cached (chunks on disk counted as the request finds them
   after its prefetch; only a corrupt one, which explain does not read, differs); the
   Prometheus counter counts the missed tokens by reason.
2. The same through `LLM` and the offline `RequestOutput`.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
import transformers
from helpers import kv_bytes_per_token, save_random_checkpoint
from server_process import ServerProcess, running

from kvserve import LLM, SamplingParams
from kvserve.kv.bounded import BoundedKVConfig
from kvserve.kv.report import REASONS

BS = 16
REPORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, kv_cache_report=True)


def toks(seed: int, n: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def reason(report: dict) -> str:
    return report["first_miss"]["reason"]


# -- 1. through the server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvserve.model_loader.make_model import ensure_default_model

    tiny = str(ensure_default_model())
    # a pool of 24 blocks: a few prompts evict the first one; every caller the admin, so the
    # reports are the full ones (cached text, the salt reason)
    proc = ServerProcess("report", [tiny, "--block-size", str(BS), "--kv-cache-memory-bytes",
                                    str(24 * BS * kv_bytes_per_token(tiny)), "--dtype",
                                    "float32", "--allow-unauthenticated-admin"],
                         tmp_path_factory.mktemp("report-logs"))
    with running(proc):
        yield proc


def complete(server, prompt, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "kv_cache_report": True,
            **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def explain(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/cache/explain", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def checked(server, prompt, **fields) -> dict:
    """Explain, then run: the request's report is the explained one, and its cached tokens
    are those the usage reports."""
    explained = explain(server, prompt=prompt, **{k: v for k, v in fields.items()
                                                  if k in ("cache_salt", "prompt_logprobs")})
    body = complete(server, prompt, **fields)
    report = body["kv_cache_report"]
    assert report["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert report["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert sum(report["cached_tokens_by_source"].values()) == report["cached_tokens"]
    assert report["missed_tokens"] == report["prompt_tokens"] - report["cached_tokens"]
    assert explained["cached_tokens"] == report["cached_tokens"]
    assert explained["cached_tokens_by_source"] == report["cached_tokens_by_source"]
    assert explained["first_miss"]["reason"] == reason(report)
    assert explained["first_miss"]["position"] == report["first_miss"]["position"]
    return report


def test_reasons_through_the_server(server):
    a = toks(1, 40)  # 2 full blocks + 8 tokens
    r = checked(server, a)
    assert (reason(r), r["cached_tokens"], r["first_miss"]["position"]) == ("never_seen", 0, 0)

    r = checked(server, a)  # the same prompt: its last 8 tokens are below the block size
    assert (reason(r), r["cached_tokens"]) == ("partial_block", 32)
    assert r["first_miss"]["tail_tokens"] == 7 and r["first_miss"]["block_size"] == BS

    b = toks(2, 33)  # 2 full blocks + the last token
    checked(server, b)
    r = checked(server, b)
    assert (reason(r), r["cached_tokens"], r["first_miss"]["position"]) == ("last_token", 32, 32)

    c = a[:20] + toks(3, 28)  # leaves `a` at position 20, inside its second block
    r = checked(server, c)
    assert reason(r) == "diverged" and r["first_miss"]["position"] == 20
    miss = r["first_miss"]
    assert miss["diverged_at"] == 20 and miss["text_before"] and miss["prompt_text"]
    assert miss["cached_text"] and miss["prompt_text"] != miss["cached_text"]
    assert r["cached_tokens_by_source"]["device"] == 20

    r = checked(server, a, cache_salt="tenant-b")  # `a` is cached, but not under this salt
    assert reason(r) == "salt" and r["cached_tokens"] == 0
    assert not any(isinstance(v, str) and v for k, v in r["first_miss"].items()
                   if k.endswith("text")), "another tenant's text is shown"

    r = checked(server, b, prompt_logprobs=0)
    assert (reason(r), r["cached_tokens"], r["first_miss"]["position"]) == \
        ("prompt_logprobs", 0, 0)

    # evicted: fill the 24-block pool with other prompts, LRU evicts `b`'s blocks
    for seed in range(10, 16):
        complete(server, toks(seed, 64))
    r = checked(server, b)
    assert reason(r) == "evicted" and r["cached_tokens"] == 0
    assert r["first_miss"]["policy"] == "lru"
    assert r["first_miss"]["evicted_seconds_ago"] >= 0
    assert 0 <= r["first_miss"]["pool_usage_at_eviction"] <= 1  # held by requests then


def test_chat_and_explain_of_messages(server):
    messages = [{"role": "system", "content": "You answer in one word. " * 6},
                {"role": "user", "content": "What colour is the sky on a clear day?"}]
    before = explain(server, messages=messages)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 2, "kv_cache_report": True})
    assert r.status_code == 200, r.text
    report = r.json()["kv_cache_report"]
    assert before["cached_tokens"] == report["cached_tokens"]
    assert before["first_miss"]["reason"] == reason(report)
    after = explain(server, messages=messages)  # now the same messages find their blocks
    again = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 2, "kv_cache_report": True})
    assert after["cached_tokens"] == again.json()["kv_cache_report"]["cached_tokens"] > 0


def test_report_only_when_asked_streamed_and_refusals(server):
    body = complete(server, toks(30, 20), kv_cache_report=False)
    assert "kv_cache_report" not in body
    prompt = toks(31, 36)
    complete(server, prompt)
    for path, field in (("completions", {"prompt": prompt}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        with httpx.stream("POST", f"{server.url}/v1/{path}", timeout=60,
                          json={**field, "max_tokens": 2, "stream": True,
                                "kv_cache_report": True}) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines()
                      if ln.startswith("data: {")]
        # the last chunk carries the report, and only it
        assert [("kv_cache_report" in e) for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1]["choices"] == [] and events[-1]["kv_cache_report"]["prompt_tokens"]
    assert events[0]["object"] == "chat.completion.chunk"
    r = httpx.post(f"{server.url}/v1/cache/explain", timeout=30, json={})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/cache/explain", timeout=30,
                   json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400


def test_missed_tokens_counted_by_reason(server):
    a = toks(40, 40)
    complete(server, a)
    complete(server, a)  # never_seen 40, then partial_block 8
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("kvserve:prompt_tokens_missed_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('reason="')[1].split('"')[0]] = float(value)
    assert counts.get("never_seen", 0) >= 40 and counts.get("partial_block", 0) >= 8
    assert set(counts) <= set(REASONS)


@pytest.fixture(scope="module")
def more_servers(mistral, tmp_path_factory):
    """A sliding-window model (window), a disk tier (its source, tier_error) and an engine-wide
    SnapKV bounded cache (bounded), started at once so that their start-ups overlap."""
    from kvserve.model_loader.make_model import ensure_default_model

    tiny = str(ensure_default_model())
    logs = tmp_path_factory.mktemp("report-more-logs")
    disk = tmp_path_factory.mktemp("report-disk")
    tiers = logs / "tiers.yaml"
    tiers.write_text(f"chunk_size: {2 * BS}\nlocal_cpu: false\nlocal_disk: {disk}\n"
                     "max_local_disk_size: 0.01\n")

    def pool(model, blocks):
        return ["--block-size", str(BS), "--dtype", "float32", "--kv-cache-memory-bytes",
                str(blocks * BS * kv_bytes_per_token(model))]

    procs = {"window": ServerProcess("window", [str(mistral), *pool(mistral, WINDOW_POOL)],
                                     logs),
             "disk": ServerProcess("disk", [tiny, *pool(tiny, 12), "--kv-tier-config",
                                            str(tiers)], logs),
             "bounded": ServerProcess("bounded", [tiny, *pool(tiny, 64), "--bounded-kv-policy",
                                                  "snapkv", "--bounded-kv-budget", "24",
                                                  "--bounded-kv-observation-window", "8"],
                                      logs)}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs, disk
    finally:
        codes = {name: proc.stop() for name, proc in procs.items()}
    assert set(codes.values()) == {None}, {n: p.log()[-2000:] for n, p in procs.items()}


def test_window_through_the_server(more_servers):
    server = more_servers[0]["window"]
    report = window_case(lambda p: checked(server, p))
    assert reason(report) == "window" and report["first_miss"]["window"] == 32


def test_bounded_through_the_server(more_servers):
    server = more_servers[0]["bounded"]
    a = toks(5, 48)
    checked(server, a)
    report = checked(server, a)
    assert (reason(report), report["cached_tokens"]) == ("bounded", 0)


def _saved_chunks(disk, before: set) -> set:
    """The chunk files written since `before`, once the saver has stopped writing."""
    deadline, last = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        now = set(disk.glob("*.kvchunk")) - before
        if now and now == last:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError("no chunk was saved")


def test_disk_source_and_tier_error_through_the_server(more_servers):
    procs, disk = more_servers
    server = procs["disk"]
    a, b, c, d = (toks(s, 150) for s in (8, 9, 18, 19))
    complete(server, a)
    complete(server, b)  # evicts `a`: its chunks go to disk
    _saved_chunks(disk, set())
    report = checked(server, a)  # prefetched from disk, then loaded; explain counts it too
    assert report["cached_tokens_by_source"]["disk"] > 0
    assert sum(report["cached_tokens_by_source"].values()) == report["cached_tokens"]
    before = set(disk.glob("*.kvchunk"))
    complete(server, c)
    complete(server, d)  # evicts `c`
    for f in _saved_chunks(disk, before):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    # explain reads no chunk: only the load finds this one corrupt
    report = complete(server, c)["kv_cache_report"]
    assert reason(report) == "tier_error", report
    assert report["first_miss"]["tier"] == "disk"
    assert report["first_miss"]["error"] == "corrupt_chunk"


# -- 2. offline: LLM and RequestOutput ----------------------------------------------------------
def llm_for(model_dir, pool_blocks: int = 64, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=512, block_size=BS,
               kv_cache_memory_bytes=pool_blocks * BS * kv_bytes_per_token(model_dir), **kwargs)


def run(llm: LLM, prompt, params=REPORT, **extra) -> dict:
    [out] = llm.generate([{"prompt_token_ids": prompt, **extra}], params, use_tqdm=False)
    report = out.kv_cache_report
    assert report is not None and report["cached_tokens"] == out.num_cached_tokens
    return report


def test_offline_report_and_off_by_default(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    a = toks(1, 40)
    assert reason(run(llm, a)) == "never_seen"
    [out] = llm.generate([{"prompt_token_ids": a}], SamplingParams(max_tokens=2),
                         use_tqdm=False)
    assert out.kv_cache_report is None and out.num_cached_tokens == 32
    assert reason(run(llm, a)) == "partial_block"
    # another salt holds `a`; explain (read-only) says so too, and changes nothing
    assert llm.engine.explain_cache({"prompt_token_ids": a}, "t2")["first_miss"]["reason"] \
        == "salt"
    assert reason(run(llm, a, cache_salt="t2")) == "salt"
    stats = llm.engine.stats()
    assert stats.missed_tokens["never_seen"] == 40 and stats.missed_tokens["salt"] == 40
    with pytest.raises(ValueError, match="kv_cache_report"):
        SamplingParams(kv_cache_report="yes")


def test_bounded_requests_skip_reading(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    a = toks(5, 48)
    run(llm, a)
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": a}, REPORT,
                             bounded_kv=BoundedKVConfig("snapkv", 24, 4, 8))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid and o.finished]
    report = outs[0].kv_cache_report
    assert (reason(report), report["cached_tokens"]) == ("bounded", 0)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=1024, rms_norm_eps=1e-6,
                                     bos_token_id=0, eos_token_id=2, pad_token_id=0,
                                     num_hidden_layers=2, sliding_window=32,
                                     tie_word_embeddings=False, rope_theta=1e4)
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("mistral") / "m", seed=3)


WINDOW_POOL = 16  # blocks


def window_case(run_prompt) -> dict:
    """A 160-token prompt (10 blocks; window 32) leaves 10 idle cached blocks and 6 free; a
    230-token one needs 15, so LRU hollows the long prompt's 9 shallowest blocks and keeps its
    last: the path is still in the index, but a hit anywhere on it lacks blocks its window
    needs. Returns the long prompt's report the second time."""
    a, b = toks(7, 160, vocab=250), toks(17, 230, vocab=250)
    run_prompt(a)
    run_prompt(b)
    return run_prompt(a)


def test_window(mistral):
    llm = llm_for(mistral, pool_blocks=WINDOW_POOL)
    report = window_case(lambda p: run(llm, p))
    assert reason(report) == "window" and report["first_miss"]["window"] == 32
    assert report["first_miss"]["cached_path_tokens"] > 0


def test_tier_sources_and_tier_error(tiny_model_dir, tmp_path):
    """Host memory serves an evicted prompt (source `host`); a corrupt chunk on disk is a
    `tier_error`."""
    chunk = 2 * BS
    host = llm_for(tiny_model_dir, pool_blocks=12,
                   kv_tier_config={"chunk_size": chunk, "local_cpu": True,
                                   "max_local_cpu_size": 0.01})
    a, b = toks(8, 150), toks(9, 150)
    run(host, a)
    run(host, b)  # evicts `a` into host memory
    assert host.engine.tiers.flush()
    report = run(host, a)
    assert report["cached_tokens_by_source"]["host"] > 0
    assert sum(report["cached_tokens_by_source"].values()) == report["cached_tokens"]

    disk_dir = tmp_path / "disk"
    disk = llm_for(tiny_model_dir, pool_blocks=12,
                   kv_tier_config={"chunk_size": chunk, "local_cpu": False,
                                   "local_disk": str(disk_dir), "max_local_disk_size": 0.01})
    run(disk, a)
    run(disk, b)
    assert disk.engine.tiers.flush()
    for f in disk_dir.glob("*.kvchunk"):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    report = run(disk, a)
    assert reason(report) == "tier_error", report
    assert report["first_miss"]["tier"] == "disk"
    assert report["first_miss"]["error"] == "corrupt_chunk"


def test_explain_changes_nothing(tiny_model_dir):
    """explain admits nothing, counts nothing, touches no LRU order."""
    llm = llm_for(tiny_model_dir)
    a = toks(50, 40)
    run(llm, a)
    kv = llm.engine.kv

    def state():
        nodes = sorted((n.block, n.last_access, n.hit_count)
                       for n in kv.index._node_of_block.values())
        return (nodes, kv.prefix_cache_queries, kv.prefix_cache_hits, dict(kv.hit_tokens),
                kv.num_available_blocks, dict(llm.engine.stats().missed_tokens))

    before = state()
    for prompt in (a, a[:20] + toks(51, 20), toks(52, 40)):
        llm.engine.explain_cache({"prompt_token_ids": prompt})
    assert state() == before and not kv.block_tables


def test_eviction_record_is_bounded():
    from kvserve.kv.evicted import EvictionRecord

    record = EvictionRecord(capacity=3)
    for h in range(5):
        record.record(h, (float(h), "lru", 0.5))
    assert len(record) == 3 and record.get(0) is None and record.get(4) == (4.0, "lru", 0.5)
    record.record(2, (9.0, "lfu", 1.0))  # evicted again: the newest stamp, kept longest
    record.record(5, (5.0, "lru", 0.5))
    assert record.get(3) is None and record.get(2) == (9.0, "lfu", 1.0)
