"""Differential guard: caching features must never change outputs.

Each hypothesis example is a random workload (tests/differential.py): shared prefixes cut
anywhere (partial-block copy-on-write hits), n > 1, aborts, a small pool (eviction into the
tiers, preemption), a small step budget (chunked prefill), and load/copy races: a prompt pushed
out to the tiers, then in one step one request that loads its chunks and another whose match
ends inside a block of a loaded chunk. It is played through the public engine API twice, with
the feature under test on and off, and the two runs must give identical greedy tokens and
logprobs within 1e-4 (fp32): tiers on (every combination of host memory, a real temp-dir disk
tier and a real redis-server) against tiers off, prefix caching on against off,
preemption by swap against preemption by recompute, and speculative decoding (ngram, suffix)
against none; each also with the feature on under
tensor_parallel_size=2 against one process with it off. Both runs
check the engine's invariants after every step and that no KV block is held at the end.

Examples are derandomised (CI runs the same ones every time). Against a runner that applies
copy-on-write copies before tier loads (issue 11, defect 1), every tier combination fails on its
5th example, half a second in (then hypothesis spends about a minute per combination shrinking
it to a minimal workload).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import pytest
from differential import (MAX_MODEL_LEN as MAX_LEN, TIER_COMBOS, DrawChooser, RunResult, Tiers, Workload, compare,
                          make_llm, make_workload, run)
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

EXAMPLES_PER_TIER_COMBO = 30
EXAMPLES_PREFIX_CACHING = 30
EXAMPLES_SWAP = 30
# With tensor_parallel_size=2 (the feature on, over two worker processes) against one process
# with it off: fewer examples (each starts two workers), the first of the same sequence.
EXAMPLES_TP = 8

# The same 30 workloads in every run and every test order: a fixed seed, no example database,
# and no source constants in the draws (`_no_source_constants`).
SEED = 20261130
SETTINGS = settings(max_examples=EXAMPLES_PER_TIER_COMBO, deadline=None, derandomize=False,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def workloads(draw) -> Workload:
    return make_workload(DrawChooser(draw))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """conftest's Llama checkpoint made by transformers (only this one, to keep the file fast):
    its weights are spread wide, so the greedy continuation depends on the whole context and a
    wrong KV block shows in the tokens and logprobs."""
    from conftest import make_hf_checkpoint

    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("diff") / "llama")


@pytest.fixture(autouse=True)
def _no_source_constants(monkeypatch):
    """Hypothesis mixes integer literals of every local module imported so far into its draws
    (5% of them), so the examples, and the tier-hit count asserted below, depended on which
    other test files pytest had imported first: this file alone failed that count (21 of 30
    workloads with tier hits), the whole suite passed it. Without those constants the
    workloads are a function of SEED alone. (An internal hook: where a Hypothesis version
    lacks it, nothing is patched; constraints.txt pins the version the suite passed with.)"""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        warnings.warn("this Hypothesis has no hypothesis.internal.conjecture.providers: the "
                      "workloads may depend on the other test modules imported", stacklevel=1)
        return
    if hasattr(providers.HypothesisProvider, "_maybe_draw_constant"):
        monkeypatch.setattr(providers.HypothesisProvider, "_maybe_draw_constant",
                            lambda self, *args, **kwargs: None)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def run_with_tiers(model_dir: Path, w: Workload, combo: str, redis_server, tp: int = 1
                   ) -> RunResult:
    """One run with tiers on: a fresh disk dir and an emptied Redis, so examples are
    independent; the engine's tier threads are stopped before the next example."""
    if redis_server is not None:
        redis_server.client().flushall()
    tiers = Tiers(combo, redis_url=redis_server.url if redis_server is not None else None)
    llm = make_llm(model_dir, w, tiers=tiers, tp=tp)
    try:
        return run(llm, w)
    finally:
        llm.engine.shutdown()
        tiers.cleanup()


def run_shut(llm, w: Workload, **kwargs) -> RunResult:
    """run(), then the engine shut down (a tensor-parallel one's workers stopped)."""
    try:
        return run(llm, w, **kwargs)
    finally:
        llm.engine.shutdown()


# A soak (what benchmarks/soak_differential.py ran before issue 51): the same derandomised
# workloads and as many more as asked, e.g.
# KVSERVE_DIFFERENTIAL_SCALE=40 pytest tests/test_differential.py -k tiers
SCALE = max(1, int(os.environ.get("KVSERVE_DIFFERENTIAL_SCALE", "1")))


def _examples(n: int, tp: int) -> settings:
    return settings(SETTINGS, max_examples=SCALE * (n if tp == 1 else EXAMPLES_TP))


@pytest.mark.parametrize("combo,tp", [(c, 1) for c in TIER_COMBOS] + [("host+disk+redis", 2)])
def test_tiers_do_not_change_outputs(model_dir, combo, tp, request):
    redis_server = request.getfixturevalue("redis_server") if "redis" in combo else None
    tier_hits = []

    @seed(SEED)
    @_examples(EXAMPLES_PER_TIER_COMBO, tp)
    @given(workloads())
    def check(w: Workload) -> None:
        want = run(make_llm(model_dir, w), w)
        got = run_with_tiers(model_dir, w, combo, redis_server, tp)
        diffs = compare(want, got)
        assert not diffs, (f"tiers ({combo}) changed {len(diffs)} outputs:\n" + "\n".join(diffs)
                           + "\nworkload:\n" + w.describe())
        tier_hits.append(sum(got.stats.hit_tokens[s] for s in ("host", "disk", "remote")))

    check()
    # Not vacuous: the workloads really loaded KV back from the tiers (tp=2's first 8: 7 do;
    # the first loads nothing)
    assert sum(1 for h in tier_hits if h > 0) >= (0.9 if tp == 1 else 0.85) * len(tier_hits), \
        tier_hits


@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_caching_does_not_change_outputs(model_dir, tp):
    hits = []

    @seed(SEED)
    @_examples(EXAMPLES_PREFIX_CACHING, tp)
    @given(workloads())
    def check(w: Workload) -> None:
        want = run(make_llm(model_dir, w, prefix_caching=False), w)
        got = run_shut(make_llm(model_dir, w, prefix_caching=True, tp=tp), w)
        diffs = compare(want, got)
        assert not diffs, (f"prefix caching changed {len(diffs)} outputs:\n" + "\n".join(diffs)
                           + "\nworkload:\n" + w.describe())
        hits.append(got.stats.hit_tokens["device"])

    check()
    assert all(h > 0 for h in hits), hits


@pytest.mark.parametrize("tp", [1, 2])
def test_swap_preemption_does_not_change_outputs(model_dir, tp):
    swaps = []

    @seed(SEED)
    @_examples(EXAMPLES_SWAP, tp)
    @given(workloads())
    def check(w: Workload) -> None:
        # Longer outputs, and a pool just big enough for the longest request: decodes outgrow it.
        w = _longer_outputs(w)
        w = dataclasses.replace(w, pool_blocks=_blocks_for_longest(w))
        want = run(make_llm(model_dir, w, preemption_mode="recompute"), w)
        got = run_shut(make_llm(model_dir, w, preemption_mode="swap", tp=tp), w)
        diffs = compare(want, got)
        assert not diffs, (f"swap preemption changed {len(diffs)} outputs:\n" + "\n".join(diffs)
                           + "\nworkload:\n" + w.describe())
        swaps.append(got.stats.swap)

    check()
    # Not vacuous: many workloads preempted a request and loaded its swapped KV back (12 of
    # the 30; in the others the few concurrent requests fit, or the device kept the blocks).
    assert sum(1 for s in swaps if s["swapped_in"] > 0) >= len(swaps) // 3, swaps


def _longer_outputs(w: Workload) -> Workload:
    """The workload with each request's output about 4x longer (within the context)."""
    def longer(r):
        return dataclasses.replace(r, max_tokens=min(4 * r.max_tokens + 16,
                                                     MAX_LEN - len(r.prompt)))

    return dataclasses.replace(w, phases=[dataclasses.replace(p, adds=[longer(r) for r in p.adds])
                                          for p in w.phases])


def _blocks_for_longest(w: Workload) -> int:
    """A pool just big enough for the workload's longest request (and one block more)."""
    longest = max(len(r.prompt) + r.max_tokens for p in w.phases for r in p.adds)
    return -(-longest // w.block_size) + 1


EXAMPLES_SPEC = 15


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_does_not_change_outputs(model_dir, method):
    """Speculative decoding (issue 49) against none on the same workloads: drafts written into
    paged blocks before they are verified, rejected ones rolled back, through shared prefixes,
    chunked prefill, n > 1, aborts and a pool small enough to preempt: the same greedy tokens
    and logprobs, every block back at the end."""
    drafted = []

    @seed(SEED)
    @settings(SETTINGS, max_examples=EXAMPLES_SPEC)
    @given(workloads())
    def check(w: Workload) -> None:
        w = _longer_outputs(w)  # (long greedy outputs of the random model repeat: drafts)
        w = dataclasses.replace(w, pool_blocks=max(w.pool_blocks, _blocks_for_longest(w)))
        want = run(make_llm(model_dir, w), w)
        spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
        got = run_shut(make_llm(model_dir, w, speculative_config=spec), w)
        diffs = compare(want, got)
        assert not diffs, (f"speculation ({method}) changed {len(diffs)} outputs:\n"
                           + "\n".join(diffs) + "\nworkload:\n" + w.describe())
        drafted.append(got.stats.spec_decode.get("num_draft_tokens", 0))

    check()
    # Not vacuous: most workloads drafted (greedy outputs of the random model repeat)
    assert sum(1 for d in drafted if d > 0) >= 0.8 * len(drafted), drafted


EXAMPLES_ISOLATION = 15


def test_kv_isolation_does_not_change_outputs(model_dir):
    """--kv-isolation api_key (kvserve/frontend/tenancy.py: a key's digest, and within it a salt, as
    the engine's cache_salt) against everybody in one namespace: the same tokens and
    logprobs, with fewer hits (the isolation took effect: a tenant never reads another's
    blocks)."""
    from kvserve.frontend.tenancy import cache_namespace, key_digest

    keys = [key_digest(f"sk-tenant-{i}") for i in range(3)]

    def tenant(rid: str) -> str | None:  # three keys; one of them also uses a salt
        i = int(rid[1:])
        return cache_namespace("api_key", "s" if i % 5 == 0 else None, keys[i % 3])

    hits = []

    @seed(SEED)
    @settings(SETTINGS, max_examples=EXAMPLES_ISOLATION)
    @given(workloads())
    def check(w: Workload) -> None:
        want = run(make_llm(model_dir, w), w)
        got = run_shut(make_llm(model_dir, w), w, namespace=tenant)
        diffs = compare(want, got)
        assert not diffs, (f"kv isolation changed {len(diffs)} outputs:\n" + "\n".join(diffs)
                           + "\nworkload:\n" + w.describe())
        hits.append((want.stats.hit_tokens["device"], got.stats.hit_tokens["device"]))

    check()
    assert all(isolated <= shared for shared, isolated in hits), hits
    assert sum(isolated < shared for shared, isolated in hits) >= len(hits) // 2, hits


def test_the_comparison_can_fail():
    """compare() itself: a logprob off by more than the tolerance, or a different token that
    was not a tie, is reported; a true tie is not."""
    from differential import Completion

    def result(tokens, lps) -> RunResult:
        return RunResult({"r": [Completion(tokens, lps)]}, None)

    base = result([5, 6], [{5: -1.0, 7: -2.0}, {6: -0.5, 8: -3.0}])
    assert compare(base, base) == []
    assert compare(base, result([5, 6], [{5: -1.0, 7: -2.0}, {6: -0.5002, 8: -3.0}]))
    assert compare(base, result([5, 8], [{5: -1.0, 7: -2.0}, {8: -0.4, 6: -0.5}]))
    tie = result([5, 6], [{5: -1.0, 7: -2.0}, {6: -0.50001, 8: -0.50002}])
    assert compare(tie, result([5, 8], [{5: -1.0, 7: -2.0}, {8: -0.5, 6: -0.5}])) == []
