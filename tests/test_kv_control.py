"""Retention, pins, tenant quotas and audit drops at the KV-manager level (issue 33 items 3-5),
without a model: what survives a burst is read straight off the prefix index, and every test
ends by checking the manager's invariants (ref counts = block tables + pins)."""

from __future__ import annotations

import re

import pytest

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import PinLimitError
from kvserve.kv.retention import (CACHE_CONTROL_PRIORITY, DEFAULT_PRIORITY, EXPIRED, Retention,
                                  RetentionRange, cache_control_range, kv_retention_range,
                                  parse_duration, retain_sequence)
from kvserve.request import Request
from kvserve.sampling import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager(num_blocks: int = 16, clock: Clock | None = None) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS)
    if clock is not None:
        kv.index.clock = clock
    return kv


def _serve(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None,
           tenant: str | None = None, retention: Retention | None = None) -> int:
    """Run one request through the cache as the scheduler does (admit, compute, publish,
    retain, finish); returns the tokens it found cached."""
    req = Request(request_id=rid, prompt_token_ids=list(tokens),
                  sampling_params=SamplingParams(max_tokens=1, kv_retention=retention),
                  max_tokens=1, cache_salt=salt)
    req.tenant = tenant
    match = kv.match(req)
    admission = kv.admit(req, match, len(tokens) - match.num_tokens)
    assert admission is not None, "the pool should hold one request"
    if retention is not None:
        retain_sequence(kv, req, retention, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    if retention is not None:
        retain_sequence(kv, req, retention, len(tokens))
    kv.end_step()
    kv.free(req)
    kv.check_invariants([])
    return admission.num_computed_tokens


def _cached_blocks(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    probe = Request(request_id="probe", prompt_token_ids=list(tokens) + [0],
                    sampling_params=SamplingParams(max_tokens=1), max_tokens=1, cache_salt=salt)
    return kv.device_match(probe).num_full_blocks


def _prompt(seed: int, blocks: int) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BS)]


def _burst(kv: KVCacheManager, start: int, count: int, blocks: int = 4, **kw) -> None:
    for i in range(count):
        _serve(kv, f"burst-{start + i}", _prompt(start + i, blocks), **kw)


# -- parsing ---------------------------------------------------------------------------------
def test_retention_fields_parse_and_refuse():
    assert parse_duration("5m", "ttl") == 300.0 and parse_duration(90, "ttl") == 90.0
    assert parse_duration("250ms", "ttl") == 0.25 and parse_duration("1h", "ttl") == 3600.0
    r = cache_control_range({"type": "ephemeral"}, 12)
    assert (r.end, r.priority, r.ttl, r.after) == (12, CACHE_CONTROL_PRIORITY, 300.0, EXPIRED)
    assert cache_control_range({"type": "ephemeral", "ttl": "1h"}, None).ttl == 3600.0
    r = kv_retention_range({"priority": 80, "ttl": "10s", "num_tokens": 8})
    assert (r.end, r.priority, r.ttl, r.after) == (8, 80, 10.0, DEFAULT_PRIORITY)
    for bad, match in [({"type": "persistent"}, "ephemeral"), ({"type": "ephemeral",
                       "ttl": "2h"}, "5m"), ({"type": "ephemeral", "x": 1}, "unknown"),
                       ("5m", "object")]:
        with pytest.raises(ValueError, match=match):
            cache_control_range(bad, None)
    for bad, match in [({"priority": 101}, "0..100"), ({"priority": True}, "0..100"),
                       ({"ttl": -1}, "positive"), ({"ttl": "soon"}, "duration"),
                       ({"num_tokens": 0}, "positive"), ({"prio": 1}, "unknown")]:
        with pytest.raises(ValueError, match=match):
            kv_retention_range(bad)
    with pytest.raises(ValueError, match="kv_retention"):
        SamplingParams(kv_retention="high")
    assert isinstance(SamplingParams(kv_retention={"priority": 90}).kv_retention, Retention)


def test_strongest_range_decides_a_block():
    ret = Retention((RetentionRange(8, 50, None), RetentionRange(4, 90, 10.0)))
    assert ret.for_block_end(4, 20).priority == 90
    assert ret.for_block_end(8, 20).priority == 50
    assert ret.for_block_end(12, 20) is None
    assert Retention((RetentionRange(None, 60),)).for_block_end(20, 20).priority == 60


# -- retention -------------------------------------------------------------------------------
def test_retained_prefix_outlives_a_burst_that_evicts_a_plain_one():
    """16 blocks; a 4-block prefix, then a burst of 4-block prompts that fills the pool many
    times: under LRU the plain prefix goes, a prefix with priority 90 stays."""
    for retention, survives in [(None, False),
                                (Retention((RetentionRange(None, 90),)), True)]:
        kv = _manager()
        hot = _prompt(99, 4)
        _serve(kv, "hot", hot, retention=retention)
        _burst(kv, 0, 12)
        assert _cached_blocks(kv, hot) == (4 if survives else 0)


def test_low_priority_goes_before_default():
    kv = _manager()
    cold = _prompt(98, 4)
    _serve(kv, "cold", cold, retention=Retention((RetentionRange(None, 10),)))
    _serve(kv, "plain", _prompt(97, 4))  # newer than nothing, older than the burst
    _burst(kv, 0, 2)  # 16 blocks full: the next request evicts 4
    _serve(kv, "one-more", _prompt(50, 4))
    assert _cached_blocks(kv, cold) == 0 and _cached_blocks(kv, _prompt(97, 4)) == 4


def test_ttl_keeps_a_prefix_then_it_goes_first():
    """A cache_control breakpoint (priority 90 for 5 minutes, then EXPIRED): it survives a burst
    inside its TTL; after it, it is the first block evicted, before older plain blocks."""
    clock = Clock()
    kv = _manager(clock=clock)
    hot = _prompt(99, 4)
    ret = Retention((cache_control_range({"type": "ephemeral", "ttl": "5m"}, None),))
    _serve(kv, "hot", hot, retention=ret)
    _burst(kv, 0, 12)
    assert _cached_blocks(kv, hot) == 4
    clock.now += 299
    _burst(kv, 20, 3)
    assert _cached_blocks(kv, hot) == 4, "inside its TTL"
    clock.now += 2
    oldest = _prompt(22, 4)  # the oldest plain prompt still cached
    assert _cached_blocks(kv, oldest) == 4
    _serve(kv, "next", _prompt(40, 4))  # needs 4 blocks: the expired prefix's
    assert _cached_blocks(kv, hot) == 0 and _cached_blocks(kv, oldest) == 4


def test_a_hit_refreshes_the_ttl():
    clock = Clock()
    kv = _manager(clock=clock)
    hot = _prompt(99, 4)
    ret = Retention((cache_control_range({"type": "ephemeral"}, None),))
    _serve(kv, "hot", hot, retention=ret)
    clock.now += 200
    assert _serve(kv, "hot-again", hot, retention=ret) == 4 * BS - 1  # all but the last token
    clock.now += 200  # 400 s after the first use, 200 after the hit that refreshed the TTL
    _burst(kv, 0, 12)
    assert _cached_blocks(kv, hot) == 4


def test_breakpoint_covers_only_the_tokens_before_it():
    kv = _manager()
    prompt = _prompt(99, 4)
    _serve(kv, "bp", prompt, retention=Retention((RetentionRange(2 * BS, 90),)))
    _burst(kv, 0, 12)
    assert _cached_blocks(kv, prompt) == 2  # the first two blocks were retained


# -- pins ------------------------------------------------------------------------------------
def _pin_probe(tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id="pin", prompt_token_ids=list(tokens) + [0],
                   sampling_params=SamplingParams(max_tokens=1), max_tokens=1, cache_salt=salt)


def test_pinned_prefix_survives_everything_and_unpin_lets_it_go():
    kv = _manager()
    hot = _prompt(99, 4)
    _serve(kv, "hot", hot)
    pin = kv.pins.pin(_pin_probe(hot), len(hot))
    assert pin is not None and pin.num_tokens == 4 * BS and kv.pins.num_pinned_blocks == 4
    kv.check_invariants([])
    assert kv.num_available_blocks == 12
    _burst(kv, 0, 20)  # every unpinned block is evicted many times over
    assert _cached_blocks(kv, hot) == 4
    assert kv.pins.unpin(pin.id) is not None and kv.pins.unpin(pin.id) is None
    kv.check_invariants([])
    assert kv.num_available_blocks == 16
    _burst(kv, 30, 4)
    assert _cached_blocks(kv, hot) == 0


def test_pins_are_bounded_by_the_fraction():
    kv = _manager()  # 16 blocks, default 0.5: 8 pinnable
    a, b = _prompt(90, 4), _prompt(91, 4)
    for rid, p in (("a", a), ("b", b)):
        _serve(kv, rid, p)
        assert kv.pins.pin(_pin_probe(p), len(p)) is not None
    c = _prompt(92, 1)
    _serve(kv, "c", c)
    with pytest.raises(PinLimitError, match="max-pinned-fraction 0.5"):
        kv.pins.pin(_pin_probe(c), len(c))
    assert kv.pins.pin(_pin_probe(a), len(a)) is not None, "blocks pinned already count once"
    assert kv.pins.num_pinned_blocks == 8
    kv.check_invariants([])


def _pinned(kv: KVCacheManager, rid: str, tokens: list[int], owner: str):
    _serve(kv, rid, tokens)
    return kv.pins.pin(_pin_probe(tokens), len(tokens), owner)


def test_each_tenant_pins_within_its_own_budget_under_a_total_cap():
    """Issue 63 item 4: --max-pinned-fraction is each tenant's, --max-pinned-total-fraction all
    tenants'; a block two tenants pin counts in both budgets and once in the total; a refusal
    names the caller's own count only."""
    kv = _manager()  # 16 blocks: 4 per tenant, 12 in all
    kv.pins.set_max_fraction(0.25, 0.75)
    a = _prompt(80, 4)
    pin_a = _pinned(kv, "a", a, "alice")
    with pytest.raises(PinLimitError, match="your budget of 4") as refused:
        _pinned(kv, "a2", _prompt(81, 1), "alice")
    assert "5 blocks" in str(refused.value)
    # Bob's budget is his own: Alice's full budget leaves it whole; her blocks count in his
    pin_b = _pinned(kv, "b", a, "bob")
    assert kv.pins.owner_blocks("bob") == 4 and kv.pins.num_pinned_blocks == 4
    assert _pinned(kv, "c", _prompt(82, 4), "carol") and _pinned(kv, "d", _prompt(83, 4), "dan")
    with pytest.raises(PinLimitError, match="across all tenants") as capped:
        _pinned(kv, "e", _prompt(84, 1), "erin")  # erin's budget is free, the total is not
    assert "12" not in str(capped.value) and "16" not in str(capped.value)
    # the check made before any prefill: blocks another tenant pins add nothing to the total,
    # a prompt never computed counts whole
    kv.pins.check_seq_room(_pin_probe(a), 4, "erin")
    with pytest.raises(PinLimitError, match="across all tenants"):
        kv.pins.check_seq_room(_pin_probe(_prompt(85, 1)), 1, "erin")
    with pytest.raises(PinLimitError, match="your budget of 4"):
        kv.pins.check_seq_room(_pin_probe(a + _prompt(86, 1)), 5, "erin")
    assert kv.pins.pin(_pin_probe(a), len(a), "erin") is not None
    # Alice lets go: Bob still holds the shared blocks, and Alice's budget is free again
    assert kv.pins.unpin(pin_a.id, "bob") is None and kv.pins.unpin(pin_a.id, "alice")
    assert kv.pins.owner_blocks("alice") == 0 and kv.pins.num_pinned_blocks == 12
    assert _cached_blocks(kv, a) == 4
    summary = kv.pins.summary("bob")
    assert [p["id"] for p in summary["data"]] == [pin_b.id]
    assert (summary["num_pinned_blocks"], summary["limit_blocks"]) == (4, 4)
    assert kv.pins.summary(None)["num_pinned_blocks"] == 12
    kv.check_invariants([])


def test_pin_ids_are_random_not_counted():
    kv = _manager()
    ids = [_pinned(kv, f"r{i}", _prompt(70 + i, 1), "t").id for i in range(3)]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"pin-[0-9a-f]{24}", i) for i in ids), ids  # 96 random bits


def test_pins_of_no_whole_block_unpin_and_reset_cleanly():
    """A prompt shorter than a block pins nothing, twice by one owner: both unpin, and a reset
    clears them (the per-owner count had no entry for them: a KeyError, found by
    test_prefix_properties' state machine)."""
    kv = _manager()
    short = [5] * (BS - 1)
    _serve(kv, "short", short)
    pins = [kv.pins.pin(_pin_probe(short), len(short), "t") for _ in range(3)]
    assert all(p is not None and p.num_tokens == 0 for p in pins)
    assert kv.pins.unpin(pins[0].id) is not None and kv.pins.owner_blocks("t") == 0
    kv.reset_prefix_cache()
    assert len(kv.pins) == 0
    kv.check_invariants([])


def test_pin_fractions_are_checked():
    with pytest.raises(ValueError, match="max-pinned-total-fraction 0.5"):
        KVCacheManager(16, BS, max_pinned_fraction=0.8, max_pinned_total_fraction=0.5)
    with pytest.raises(ValueError, match="max_pinned_total_fraction must be in"):
        KVCacheManager(16, BS, max_pinned_total_fraction=1.5)


def test_pin_needs_the_blocks_cached_and_reset_clears_pins():
    kv = _manager()
    hot = _prompt(99, 4)
    assert kv.pins.pin(_pin_probe(hot), len(hot)) is None  # never computed
    _serve(kv, "hot", hot)
    assert kv.pins.pin(_pin_probe(hot, salt="other"), len(hot)) is None  # another salt
    assert kv.pins.pin(_pin_probe(hot), len(hot)) is not None
    kv.reset_prefix_cache()
    assert len(kv.pins) == 0 and kv.num_available_blocks == 16
    kv.check_invariants([])


# -- tenant quotas ---------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["salt", "tenant"])
def test_quota_keeps_another_tenants_prefix(by):
    """Tenant B's prefix, then tenant A's burst of distinct prompts: without quotas LRU evicts
    B's prefix; with a quota of half the pool, A, over it, evicts its own blocks."""
    for quota, survives in [(None, False), (0.5, True)]:
        kv = _manager()
        if quota is not None:
            kv.set_tenant_quota(quota)
        who = (lambda t: {"salt": t}) if by == "salt" else (lambda t: {"tenant": t})
        hot = _prompt(99, 4)
        _serve(kv, "b-hot", hot, **who("B"))
        _burst(kv, 0, 12, **who("A"))
        assert _cached_blocks(kv, hot, **({"salt": "B"} if by == "salt" else {})) == \
            (4 if survives else 0)
        if quota is not None:
            idle = kv.pool.idle_by_tenant
            assert idle["A"] <= kv.num_blocks // 2 + 4 and idle["B"] == 4


def test_quota_refuses_bad_fractions():
    with pytest.raises(ValueError, match="kv_tenant_quota"):
        _manager().set_tenant_quota(0.0)
    with pytest.raises(ValueError, match="kv_tenant_quota"):
        _manager().set_tenant_quota(1.5)


# -- audit drops -----------------------------------------------------------------------------
def test_drop_takes_a_subtree_out_even_while_held():
    kv = _manager()
    prompt = _prompt(99, 4)
    _serve(kv, "first", prompt)
    req = Request(request_id="holder", prompt_token_ids=prompt + [7],
                  sampling_params=SamplingParams(max_tokens=1), max_tokens=1)
    match = kv.match(req)
    assert match.num_full_blocks == 4
    kv.admit(req, match, 1)
    dropped = kv.index.drop(match.nodes[1])  # blocks 1..3 go, block 0 stays
    assert len(dropped) == 3 and all(n.dropped for n in dropped)
    assert _cached_blocks(kv, prompt) == 1
    kv.check_invariants([req])
    req.num_computed_tokens = len(req.token_ids)
    kv.cache_full_blocks(req)  # publishes nothing under a dropped node
    kv.free(req)
    kv.check_invariants([])
    assert kv.num_available_blocks == 16 and _cached_blocks(kv, prompt) == 1


# -- the simulator runs the same code --------------------------------------------------------
def _trace(records: list[dict]):
    from kvserve.sim.trace import TraceRequest, Trace
    reqs = [TraceRequest(len(r["token_ids"]), 1, r.get("timestamp"), r["token_ids"],
                         control={k: r[k] for k in ("tenant", "pin", "kv_retention",
                                                    "cache_control") if k in r} or None)
            for r in records]
    return Trace(reqs, source="test")


def _last_hit(records: list[dict], **config) -> int:
    from kvserve.sim.replay import Replica, SimConfig, replay

    seen = []

    def on_request(pos: int, replicas: list[Replica]) -> None:
        seen.append(replicas[0].kv.prefix_cache_hits)

    replay(_trace(records), SimConfig(capacity_tokens=16 * BS, block_size=BS,
                                      lifetime="immediate", **config), on_request)
    return seen[-1] - seen[-2]


@pytest.mark.parametrize("feature", ["quota", "pin", "retention", "ttl"])
def test_simulator_models_control_with_the_engines_code(feature):
    """The scenarios above as traces: a hot prefix, a burst, the prefix again; the replay's hit
    on the last request is the prefix (15 tokens of 16) with the feature on, nothing off."""
    hot = {"token_ids": _prompt(99, 4), "tenant": "B"}
    burst = [{"token_ids": _prompt(i, 4), "tenant": "A"} for i in range(12)]
    again = {"token_ids": _prompt(99, 4) + [5], "tenant": "B"}
    on = {"quota": ({}, {"tenant_quota": 0.5}), "pin": ({"pin": True}, {}),
          "retention": ({"kv_retention": {"priority": 90}}, {}),
          "ttl": ({"kv_retention": {"priority": 90, "ttl": 100}}, {})}[feature]
    records = [dict(hot, **on[0]), *burst, again]
    assert _last_hit(records, **on[1]) == 16
    assert _last_hit([hot, *burst, again]) == 0
    if feature == "ttl":  # timestamps past the TTL (seconds as the replay's clock)
        timed = [dict(r, timestamp=float(t)) for t, r in
                 enumerate([dict(hot, **on[0]), *burst, again], start=0)]
        timed[1:] = [dict(r, timestamp=r["timestamp"] + 200) for r in timed[1:]]
        assert _last_hit(timed) == 0
