"""The trace simulator: hit rates worked out by hand, the offline reference against the online
policies, replicas and routing, allocation modes, traces, the CLI, and the engine and the
simulator counting the same hits on the same trace."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.cli import main
from kvserve.kv.hashing import chain_hashes
from kvserve.sim import SimConfig, Trace, TraceRequest, from_token_lists, load_trace, replay
from kvserve.sim.alloc import allocation_modes
from kvserve.sim.generators import gsp, hash_mix, multi_turn
from kvserve.sim.replay import PromptHasher
from kvserve.sim.trace import write_trace

BIG = 100_000  # a token no generated prompt uses


def run(trace: Trace, capacity: int, policy: str = "lru", block_size: int = 4, **kw) -> dict:
    kw.setdefault("lifetime", "immediate")
    return replay(trace, SimConfig(capacity_tokens=capacity, block_size=block_size,
                                   policy=policy, **kw))


def flat(items: list[int], priorities: list[int] | None = None, bs: int = 4) -> Trace:
    """One block per request (item k = tokens k*bs .. k*bs+bs-1) plus one token that is always
    computed, so a hit is the whole block and a request holds two blocks while it runs."""
    reqs = [TraceRequest(bs + 1, 1, None, [k * bs + j for j in range(bs)] + [BIG])
            for k in items]
    for r, p in zip(reqs, priorities or []):
        r.priority = p
    return Trace(reqs, source="flat")


# -- hit rates by hand ----------------------------------------------------------------------------

def test_shared_system_prompt_by_hand():
    system = list(range(100, 108))  # two blocks of 4
    trace = from_token_lists([system + [1, 2, 3, 4], system + [5, 6, 7, 8], system + [9, 10, 11]])
    r = run(trace, 400)
    # request 1 computes everything; 2 and 3 hit both system blocks (8 tokens each)
    assert (r["hit_tokens"], r["query_tokens"]) == (16, 35)
    assert r["prefill_tokens_saved"] == 16 and r["prefill_tokens_computed"] == 35 - 16
    assert r["evicted_blocks"] == 0


def test_cyclic_pattern_lru_zero_belady_two():
    """Cache of 3 blocks: 2 items + the block every request's last token needs. A B C A B C:
    LRU always evicts the next item needed; Belady keeps A for position 3 and C for 5."""
    trace = flat([0, 1, 2, 0, 1, 2])
    assert run(trace, 12, "lru")["hit_tokens"] == 0
    assert run(trace, 12, "belady")["hit_tokens"] == 8
    assert run(trace, 12, "belady")["query_tokens"] == 30


def test_lfu_priority_and_lru_by_hand():
    """A A B C A: when C arrives one of A (used twice) and B (once) must go."""
    items = [0, 0, 1, 2, 0]
    assert run(flat(items), 12, "lru")["hit_tokens"] == 4  # evicts A, the least recent
    assert run(flat(items), 12, "lfu")["hit_tokens"] == 8  # evicts B, the least frequent
    assert run(flat(items), 12, "priority")["hit_tokens"] == 4  # equal priorities: LRU
    assert run(flat(items, [1, 1, 0, 0, 1]), 12, "priority")["hit_tokens"] == 8
    assert run(flat(items), 12, "belady")["hit_tokens"] == 8


def test_hash_id_trace_by_hand(tmp_path):
    lines = [{"meta": {"block_size": 4}},
             {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
             {"timestamp": 1, "input_length": 11, "output_length": 1, "hash_ids": [1, 2, 3]},
             {"timestamp": 2, "input_length": 6, "output_length": 1, "hash_ids": [1, 4]},
             {"timestamp": 3, "input_length": 3, "output_length": 1, "hash_ids": [5]},
             {"timestamp": 4, "input_length": 7, "output_length": 1, "hash_ids": [1, 2]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)
    assert trace.block_size == 4 and trace.is_hash_trace
    assert trace.prompt_tokens(trace.requests[1]) == [1] * 4 + [2] * 4 + [3] * 3
    r = run(trace, 400)
    # 0, then blocks 1+2 (8), block 1 (4), nothing, block 1 + 2 tokens of block 2 (a partial
    # hit, copied on write): 18 of 8 + 11 + 6 + 3 + 7 = 35 tokens
    assert (r["hit_tokens"], r["query_tokens"]) == (18, 35)
    assert r["block_size"] == 4


def test_multi_turn_hits_include_the_answer():
    system, u1, u2 = [100] * 4, [101, 102, 103, 104], [105, 106, 107, 108]
    answer = [110, 111, 112, 113, 114]  # 5 tokens: the last one's KV is never computed
    turn1 = TraceRequest(8, 5, None, system + u1, None, answer)
    p2 = system + u1 + answer + u2
    turn2 = TraceRequest(len(p2), 1, None, p2)
    r = run(Trace([turn1, turn2]), 400)
    # turn 1 cached S, U1 and the first 4 answer tokens (11 + 1 = 12 computed); turn 2 hits them
    assert (r["hit_tokens"], r["query_tokens"]) == (12, 8 + 17)


def test_timed_lifetime_holds_blocks_and_queues():
    prefix = [7] * 8
    reqs = [TraceRequest(9, 4, 0.0, prefix + [1]),
            TraceRequest(9, 4, 0.001, prefix + [2]),
            TraceRequest(9, 4, 0.002, [9] * 9)]
    r = replay(Trace(reqs), SimConfig(capacity_tokens=16, block_size=4, lifetime="timed"))
    # 1 holds 3 blocks; 2 shares the 2 prefix blocks and takes the 4th; 3 needs 3 blocks and
    # waits until both have finished: request 2 ends at 0.001 + 1/10,000 + 4 x 0.02 s
    assert r["hit_tokens"] == 8
    assert r["peak_usage"] == 1.0
    assert r["mean_queue_delay_s"] == pytest.approx((0.0811 - 0.002) / 3)
    assert r["rejected"] == 0


def test_a_request_that_fills_the_pool_with_a_partial_hit_is_admitted():
    """5 blocks of 2; the same 8-token prompt twice, 3 tokens out (10 tokens = the whole pool).
    The repeat hits 3 blocks and 1 token of the 4th by copy: the copy's source is locked only
    until the copy is made, so the request fits."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    trace = Trace([TraceRequest(8, 3, None, list(prompt)), TraceRequest(8, 3, None, list(prompt))])
    r = run(trace, 10, block_size=2)
    assert r["rejected"] == 0 and r["hit_tokens"] == 7


def test_request_larger_than_the_pool_is_rejected():
    r = run(from_token_lists([[1] * 40, [2] * 8]), 16)
    assert r["rejected"] == 1 and r["admitted"] == 1


def test_invariants_hold_through_a_replay():
    trace = multi_turn(num_sessions=6, turns=3, system_prompt_len=40, user_len=20,
                       output_len=12, rate=50.0, think_time_s=0.05)
    seen = []

    def check(pos, replicas):
        for rep in replicas:
            rep.kv.check_invariants(rep.running_requests())
        seen.append(pos)

    replay(trace, SimConfig(capacity_tokens=320, block_size=8, lifetime="timed"), check)
    assert len(seen) == len(trace)


# -- Belady's rule on flat traces -----------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       priorities=st.lists(st.integers(0, 2), min_size=30, max_size=30),
       capacity_blocks=st.integers(3, 7))
def test_belady_is_never_below_an_online_policy_on_flat_traces(items, priorities,
                                                               capacity_blocks):
    trace = flat(items, priorities)
    best = run(trace, 4 * capacity_blocks, "belady")["hit_tokens"]
    for policy in ("lru", "lfu", "priority"):
        assert best >= run(trace, 4 * capacity_blocks, policy)["hit_tokens"], policy


# -- replicas and routing -------------------------------------------------------------------------

def two_prefixes() -> Trace:
    a, b = list(range(10, 18)), list(range(20, 28))
    return from_token_lists([a + [1], a + [2], b + [3], b + [4]])


def test_routing_by_hand():
    trace = two_prefixes()
    assert run(trace, 400)["hit_tokens"] == 16  # one cache: A2 and B2 hit 8 each
    rr = run(trace, 400, replicas=2, routing="round_robin")
    assert rr["hit_tokens"] == 0  # A1, B1 -> 0; A2, B2 -> 1: every second copy misses
    aware = run(trace, 400, replicas=2, routing="cache_aware")
    assert aware["hit_tokens"] == 16
    assert aware["per_replica"][0]["routed"] == 2 and aware["imbalance"] == 1.0
    ch = run(trace, 400, replicas=2, routing="consistent_hash", balance_factor=100.0)
    assert ch["hit_tokens"] == 16  # the same prefix always lands on the same replica


def test_replicas_dilute_and_routing_wins_back():
    trace = gsp(num_groups=8, prompts_per_group=8, system_prompt_len=256, question_len=32,
                output_len=8, seed=1)
    one = run(trace, 64 * 1024, block_size=16)
    assert one["hit_tokens"] == 8 * 7 * 256  # every group's first request misses
    rr = run(trace, 64 * 1024, block_size=16, replicas=4, routing="round_robin")
    rand = run(trace, 64 * 1024, block_size=16, replicas=4, routing="random")
    aware = run(trace, 64 * 1024, block_size=16, replicas=4, routing="cache_aware")
    ch = run(trace, 64 * 1024, block_size=16, replicas=4, routing="consistent_hash")
    assert rr["hit_tokens"] < 0.8 * one["hit_tokens"]
    assert rand["hit_tokens"] < 0.8 * one["hit_tokens"]
    assert aware["hit_tokens"] >= 0.95 * one["hit_tokens"]
    assert ch["hit_tokens"] >= 0.85 * one["hit_tokens"]
    assert rr["imbalance"] == 1.0
    for r in (aware, ch):
        assert r["imbalance"] <= 1.25 + 4 / 64  # the load bound, up to rounding


def test_belady_needs_one_replica():
    with pytest.raises(ValueError, match="one replica"):
        SimConfig(capacity_tokens=64, policy="belady", replicas=2)


# -- allocation modes -----------------------------------------------------------------------------

def test_allocation_modes_by_hand():
    rows = {r["mode"]: r for r in allocation_modes([500], 16_384, 2048)}
    assert rows["contiguous"]["max_concurrency"] == 8  # 16,384 / 2,048
    assert rows["contiguous"]["wasted_frac"] == pytest.approx(1 - 500 / 2048)
    for mode in ("paged-16", "paged-64"):
        assert rows[mode]["max_concurrency"] == 32  # 512 tokens each
        assert rows[mode]["wasted_frac"] == pytest.approx(12 / 512)
        assert rows[mode]["expected_wasted_frac"] == pytest.approx(12 / 512)


# -- traces and hashing ---------------------------------------------------------------------------

def test_hash_ids_map_to_tokens_and_hashes_like_the_engine():
    trace = hash_mix(num_requests=200, block_size=64, seed=3)
    aligned = PromptHasher(trace, 64)
    assert aligned.aligned
    for rec in trace.requests:
        tokens = trace.prompt_tokens(rec)
        assert len(tokens) == rec.input_length
        assert aligned(rec, tokens) == chain_hashes(tokens, 64)
    # same hash id -> same tokens; different hash ids -> different tokens
    a, b = TraceRequest(8, 1, None, None, [5, 6]), TraceRequest(8, 1, None, None, [5, 7])
    t = Trace([a, b], block_size=4)
    assert t.prompt_tokens(a)[:4] == t.prompt_tokens(b)[:4]
    assert set(t.prompt_tokens(a)[4:]).isdisjoint(t.prompt_tokens(b)[4:])


def test_trace_round_trip_and_errors(tmp_path):
    trace = multi_turn(num_sessions=3, turns=2, system_prompt_len=8, user_len=4, output_len=4,
                       rate=1.0)
    path = tmp_path / "mt.jsonl"
    write_trace(trace, path)
    again = load_trace(path)
    assert [r.token_ids for r in again.requests] == [r.token_ids for r in trace.requests]
    assert again.requests[0].output_token_ids == trace.requests[0].output_token_ids
    assert again.requests[1].timestamp == pytest.approx(trace.requests[1].timestamp, abs=1e-6)
    hashed = hash_mix(num_requests=50, block_size=16)
    write_trace(hashed, tmp_path / "h.jsonl")
    back = load_trace(tmp_path / "h.jsonl")
    assert back.block_size == 16 and [r.hash_ids for r in back.requests] == \
        [r.hash_ids for r in hashed.requests]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 2000, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="does not fit"):
        load_trace(bad)
    with pytest.raises(ValueError, match="timestamp"):
        replay(from_token_lists([[1, 2, 3]]), SimConfig(capacity_tokens=64, lifetime="timed"))


def test_replay_rate_on_a_block_hash_trace():
    """The 100,000-request figure is `kvserve simulate --generator hash_mix --gen
    num_requests=100000 --capacity 1M`; this is the same replay at 5,000 requests."""
    trace = hash_mix(num_requests=5000, seed=0)
    r = replay(trace, SimConfig(capacity_tokens=512 * 4000, block_size=512))
    print(f"\nhash_mix 5,000 requests: {r['elapsed_s']:.2f} s, {r['requests_per_s']:,.0f} req/s, "
          f"hit rate {r['hit_rate']:.3f}")
    assert r["admitted"] == 5000
    assert 0.3 < r["hit_rate"] < 0.9
    assert r["elapsed_s"] < 20


# -- the command line -----------------------------------------------------------------------------

def test_cli_simulate_json_table_and_plot(tmp_path, capsys):
    png = tmp_path / "sim.png"
    args = ["simulate", "--generator", "gsp", "--gen", "num_groups=4", "--gen",
            "prompts_per_group=4", "--gen", "system_prompt_len=128", "--gen", "question_len=16",
            "--capacity", "1k,4k", "--policy", "lru,belady", "--plot", str(png)]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"trace", "runs"}
    assert [(r["policy"], r["capacity_tokens"]) for r in result["runs"]] == \
        [("lru", 1024), ("belady", 1024), ("lru", 4096), ("belady", 4096)]
    assert {"hit_rate", "prefill_tokens_saved", "evicted_blocks", "peak_usage",
            "imbalance"} <= set(result["runs"][0])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["simulate", "--generator", "gsp", "--gen", "num_groups=4", "--gen",
                 "prompts_per_group=4", "--gen", "rate=5", "--replicas", "1,2",
                 "--routing", "all", "--alloc", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "cache_aware" in out and "contiguous" in out and "paged-16" in out
    assert main(["simulate"]) == 2


# -- the engine and the simulator agree -----------------------------------------------------------

def _equivalence_trace(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 2000) for _ in range(n)] for n in (40, 70, 33)]
    prompts = []
    for _ in range(45):
        p = list(rng.choice(prefixes)) + [rng.randrange(3, 2000) for _ in range(rng.randint(1, 30))]
        prompts.append(p)
        if rng.random() < 0.2:
            prompts.append(list(p))  # a repeat: full blocks + a partial hit on the last one
    return prompts


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
def test_engine_and_simulator_count_the_same_hits(tiny_model_dir, policy):
    from kvserve import LLM, SamplingParams
    from kvserve.planner import ModelSpec, kv_bytes_per_token

    prompts = _equivalence_trace()
    rng = random.Random(1)
    priorities = [rng.randint(0, 2) for _ in prompts]
    num_blocks = 20  # 320 tokens: evictions happen
    block_bytes = kv_bytes_per_token(ModelSpec.load(str(tiny_model_dir)), "fp32") * 16
    llm = LLM(model=str(tiny_model_dir), block_size=16, kv_cache_memory_bytes=num_blocks *
              block_bytes, enable_prefix_caching=True, eviction_policy=policy)
    assert llm.engine.kv.num_blocks == num_blocks
    params = SamplingParams(max_tokens=1, temperature=0)
    for p, prio in zip(prompts, priorities):  # one after another
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False, priority=[prio])

    reqs = [TraceRequest(len(p), 1, None, p, priority=prio) for p, prio in zip(prompts,
                                                                              priorities)]
    sim = replay(Trace(reqs), SimConfig(capacity_tokens=num_blocks * 16, block_size=16,
                                        policy=policy, lifetime="immediate"))
    kv = llm.engine.kv
    assert kv.prefix_cache_hits > 0 and kv.index.num_evicted_blocks > 0
    assert sim["hit_tokens"] == kv.prefix_cache_hits
    assert sim["query_tokens"] == kv.prefix_cache_queries
    assert sim["evicted_blocks"] == kv.index.num_evicted_blocks


@pytest.mark.parametrize("prompt_len,output_len", [(10, 7), (10, 8), (16, 1), (17, 1),
                                                   (13, 4), (13, 5)])
def test_engine_and_simulator_agree_on_what_fits_the_pool(tiny_model_dir, prompt_len,
                                                          output_len):
    """One request against a pool of 4 blocks of 4 tokens, through the engine's admission
    check (add_request) and the simulator's (submit), with the same numbers. The KV a request
    ever holds is prompt + output - 1 tokens (the last sampled token is never computed), so
    both accept exactly when that fits 16 tokens, and an accepted one runs to its full length
    in the engine without a preemption."""
    from kvserve import LLM, SamplingParams
    from kvserve.planner import ModelSpec, kv_bytes_per_token

    bs, num_blocks = 4, 4
    block_bytes = kv_bytes_per_token(ModelSpec.load(str(tiny_model_dir)), "fp32") * bs
    llm = LLM(model=str(tiny_model_dir), block_size=bs, max_model_len=64,
              kv_cache_memory_bytes=num_blocks * block_bytes)
    assert llm.engine.kv.num_blocks == num_blocks
    prompt = [5 + i for i in range(prompt_len)]
    fits = prompt_len + output_len - 1 <= num_blocks * bs
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    try:
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    except ValueError as exc:
        assert "KV blocks" in str(exc)
        engine_fits = False
    else:
        engine_fits = True
        assert len(out.outputs[0].token_ids) == output_len
        assert llm.engine.scheduler.num_preemptions == 0
    sim = replay(Trace([TraceRequest(prompt_len, output_len, None, prompt)]),
                 SimConfig(capacity_tokens=num_blocks * bs, block_size=bs, lifetime="immediate"))
    assert (engine_fits, sim["admitted"] == 1) == (fits, fits)
