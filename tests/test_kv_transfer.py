"""KV transfer between instances (`kv_transfer_config`, kvserve/kv/tiers/transfer.py and
peer.py): a producer computes prompts, a consumer pulls their KV and decodes. Greedy outputs
equal transformers' own continuations (and so one colocated instance's), the consumer reports
the transferred tokens as cached, and every fault (a dead producer, a transfer that breaks
part-way, a corrupted chunk on the wire, a producer that hangs) still gives the right answer,
recomputed, within the transfer timeout, with counters saying what happened."""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers import generate_checked, hf_greedy

from kvserve import LLM, SamplingParams
from kvserve.kv.tiers import peer as peer_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

NEW = 12
BLOCK = 8


def _prompts(n: int, seed: int = 0, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(shared or []) + [rng.randrange(3, 512) for _ in range(rng.randint(20, 70))]
            for _ in range(n)]


def _llm(model, role: str, connector: str = "kvserve", producer: LLM | None = None,
         **extra) -> LLM:
    """An instance of this role; a consumer pulls from `producer` (its only configured one)."""
    cfg = {"kv_connector": connector, "kv_role": role, "kv_port": 0}
    if producer is not None:
        host, port = producer.engine.transfer.server.address
        extra["producers"] = [f"{host}:{port}"]
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return LLM(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=256,
               kv_transfer_config=cfg)


def _prefill(producer: LLM, prompts: list[list[int]]) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=1,
                            kv_transfer_params={"do_remote_decode": True})
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.kv_transfer_params for o in outs]


def _decode(consumer: LLM, prompts, transfer: list[dict | None]):
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                             kv_transfer_params=t) for t in transfer]
    return generate_checked(consumer, [{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return hf_checkpoints["llama"]


@pytest.fixture(scope="module")
def pair(llama):
    producer = _llm(llama, "kv_producer")
    consumer = _llm(llama, "kv_consumer", producer=producer)
    yield producer, consumer
    producer.engine.shutdown()
    consumer.engine.shutdown()


def test_a_consumer_decodes_what_a_producer_prefilled(llama, pair):
    producer, consumer = pair
    prompts = _prompts(8)
    expected = hf_greedy(llama, prompts, NEW)
    transfer = _prefill(producer, prompts)
    t = transfer[0]
    assert t["do_remote_prefill"] and not t["do_remote_decode"]
    assert t["remote_port"] == producer.engine.transfer.server.address[1]
    outs = _decode(consumer, prompts, transfer)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Every whole block of each prompt travelled (all but its last token are matchable).
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
    assert consumer.engine.stats().hit_tokens["peer"] == sum(o.num_cached_tokens for o in outs)


def test_the_prefix_cache_works_on_both_sides(llama, pair):
    """Prompts sharing a 32-token prefix: the producer hits its own cache for the later ones,
    the consumer its device cache (only the rest is pulled)."""
    producer, consumer = pair
    shared = _prompts(1, seed=5)[0][:32]
    prompts = _prompts(4, seed=6, shared=shared)
    expected = hf_greedy(llama, prompts, NEW)
    before = producer.engine.stats().prefix_cache_hits
    transfer = _prefill(producer, prompts)
    assert producer.engine.stats().prefix_cache_hits - before >= 3 * 32
    peer_before = consumer.engine.stats().hit_tokens["peer"]
    device_before = consumer.engine.stats().hit_tokens["device"]
    outs = _decode(consumer, prompts, transfer)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = consumer.engine.stats()
    assert stats.hit_tokens["device"] - device_before >= 3 * 32
    assert stats.hit_tokens["peer"] > peer_before


def test_the_redis_connector(llama, redis_server):
    url = redis_server.url
    producer = _llm(llama, "kv_producer", "redis", redis_url=url)
    consumer = _llm(llama, "kv_consumer", "redis", redis_url=url)
    try:
        prompts = _prompts(4, seed=7)
        expected = hf_greedy(llama, prompts, NEW)
        transfer = _prefill(producer, prompts)
        assert transfer[0]["kv_connector"] == "redis"
        outs = _decode(consumer, prompts, transfer)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert consumer.engine.stats().hit_tokens["remote"] > 0
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()


# -- faults ------------------------------------------------------------------------------------
def _fault_run(llama, pair, seed: int) -> tuple[int, dict]:
    """Prefill 3 prompts, decode them on the consumer: (tokens it got from the producer,
    the consumer's new tier errors). (Random prompts may still share a token or two with an
    earlier test's: a device hit, not a transfer, so the transfer is counted by its source.)"""
    producer, consumer = pair
    prompts = _prompts(3, seed=seed)
    expected = hf_greedy(llama, prompts, NEW)
    transfer = _prefill(producer, prompts)
    errors_before = dict(consumer.engine.tiers.stats.errors)
    peer_before = consumer.engine.stats().hit_tokens["peer"]
    t0 = time.monotonic()
    outs = _decode(consumer, prompts, transfer)
    elapsed = time.monotonic() - t0
    errors = {k: v - errors_before.get(k, 0) for k, v in consumer.engine.tiers.stats.errors.items()}
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert elapsed < 3 * 2.0 + 5, elapsed  # three prefetch deadlines at most, never a hang
    pulled = consumer.engine.stats().hit_tokens["peer"] - peer_before
    return pulled, {k: v for k, v in errors.items() if v}


def test_a_dead_producer_means_a_recompute(llama):
    producer = _llm(llama, "kv_producer")
    consumer = _llm(llama, "kv_consumer", producer=producer)
    try:
        prompts = _prompts(3, seed=8)
        transfer = _prefill(producer, prompts)
        producer.engine.shutdown()  # its chunk server is gone
        outs = _decode(consumer, prompts, transfer)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama, prompts, NEW)
        assert consumer.engine.stats().hit_tokens["peer"] == 0
        assert consumer.engine.tiers.stats.errors[("peer", "unavailable")] >= 1
    finally:
        consumer.engine.shutdown()


def test_a_transfer_cut_part_way_recomputes_the_rest(llama, pair, monkeypatch):
    """The producer's connection drops after its second chunk: the consumer keeps the chunks it
    got and recomputes from there."""
    served = []
    original = peer_module.encode

    def two_then_die(key, data, **kw):
        served.append(key)
        if len(served) > 2:
            raise ConnectionResetError("producer gone")
        return original(key, data, **kw)

    monkeypatch.setattr(peer_module, "encode", two_then_die)
    pulled, errors = _fault_run(llama, pair, seed=9)
    assert errors.get(("peer", "unavailable"), 0) >= 1, errors
    assert pulled == 2 * BLOCK  # the two chunks that arrived


def test_a_corrupted_chunk_is_caught_and_recomputed(llama, pair, monkeypatch):
    original = peer_module.encode

    def flip(key, data, **kw):
        blob = bytearray(original(key, data, **kw))
        blob[-1] ^= 0x40  # one payload byte: the checksum no longer matches
        return bytes(blob)

    monkeypatch.setattr(peer_module, "encode", flip)
    pulled, errors = _fault_run(llama, pair, seed=10)
    assert errors.get(("peer", "corrupt_chunk"), 0) >= 1, errors
    assert pulled == 0


def test_a_hanging_producer_costs_the_transfer_timeout(llama, monkeypatch):
    producer = _llm(llama, "kv_producer")
    consumer = _llm(llama, "kv_consumer", producer=producer, transfer_timeout=0.5)
    release = threading.Event()
    original = peer_module.encode

    def hang(key, data, **kw):
        release.wait(10)
        return original(key, data, **kw)

    try:
        prompts = _prompts(1, seed=11)
        transfer = _prefill(producer, prompts)
        monkeypatch.setattr(peer_module, "encode", hang)
        t0 = time.monotonic()
        outs = _decode(consumer, prompts, transfer)
        assert time.monotonic() - t0 < 5
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama, prompts, NEW)
        assert consumer.engine.stats().hit_tokens["peer"] == 0
        assert consumer.engine.tiers.stats.errors[("peer", "timeout")] >= 1
    finally:
        release.set()
        producer.engine.shutdown()
        consumer.engine.shutdown()


# -- settings and requests that are refused ------------------------------------------------------
@pytest.mark.parametrize("cfg, message", [
    ({"kv_connector": "nixl", "kv_role": "kv_producer"}, "kv_connector must be one of"),
    ({"kv_connector": "kvserve", "kv_role": "prefill"}, "kv_role must be one of"),
    ({"kv_connector": "redis", "kv_role": "kv_both"}, "needs kv_connector_extra_config.redis_url"),
    ({"kv_connector": "kvserve"}, r"needs \['kv_role'\]"),
    ({"kv_connector": "kvserve", "kv_role": "kv_both", "kv_prot": 1}, "unknown kv_transfer_config"),
    ('{"kv_connector": ', "is not JSON"),
])
def test_bad_configs_are_refused(cfg, message):
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", kv_transfer_config=cfg)


def test_requests_this_role_cannot_serve_are_refused(llama, pair):
    producer, consumer = pair
    plain = LLM(model=str(llama), dtype="float32", block_size=BLOCK, max_model_len=256)
    cases = [
        (plain, {"do_remote_decode": True}, "needs an instance started with kv_transfer_config"),
        (consumer, {"do_remote_decode": True}, "kv_producer or kv_both"),
        (producer, {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1},
         "kv_consumer or kv_both"),
        (consumer, {"do_remote_prefill": True, "remote_host": "h", "remote_port": "x"},
         "remote_port"),
    ]
    for llm, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request({"prompt_token_ids": [5, 6, 7]},
                                   SamplingParams(max_tokens=1, kv_transfer_params=params))
        assert not llm.engine.has_unfinished_requests()
