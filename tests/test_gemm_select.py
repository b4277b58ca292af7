"""GEMM kernel choice by measurement (kvserve/model/gemm_select.py): the decision rule, the
per-CPU cache, and that the engine runs with what was chosen.

Logits under every kernel choice (all dense, all oneDNN, measured, and a plan mixing kernels
across row buckets) are checked against transformers in test_model_parity.py."""

from __future__ import annotations

import json
import logging

import pytest

from kvserve.model import gemm_select as gs

N = len(gs.BUCKETS)


def _times(dense, onednn):
    return {"qkv": {"dense": dense, "onednn": onednn}}


def test_bucket_of_covers_every_row_count():
    assert [gs.bucket_of(r) for r in (1, 4, 5, 32, 33, 128, 129, 512, 513, 10**6)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert all(gs.bucket_of(probe) == i for i, (_, probe) in enumerate(gs.BUCKETS))


def test_decide_mixes_kernels_only_for_a_real_gain():
    # oneDNN 2x slower at small rows, 2x faster at large: both layouts are worth their memory
    assert gs.decide(_times([1, 1, 1, 2, 2], [2, 2, 1.05, 1, 1]))["qkv"] == \
        ["dense", "dense", "dense", "onednn", "onednn"]
    # oneDNN 3% faster at large rows only: not worth a second copy of the weights
    assert gs.decide(_times([1, 1, 1, 1, 1.03], [2, 2, 2, 1.1, 1]))["qkv"] == ["dense"] * N


def test_decide_extends_the_last_measured_bucket():
    assert gs.decide(_times([2, 2, 2, None, None], [1, 1, 1, None, None]))["qkv"] == \
        ["onednn"] * N


def test_partial_kernels_take_the_buckets_they_win():
    """The GEMV (row-major, first bucket) replaces dense by any margin; the panel GEMM (its own
    layout, above the first bucket) only by MIXED_MIN_GAIN."""
    times = {"qkv": {"dense": [1, 1, 1, 1, 1], "onednn": [2, 2, 2, 2, 2],
                     "gemv": [0.99, None, None, None, None],
                     "panel": [None, 0.95, 0.85, 0.8, 1.2]}}
    assert gs.decide(times)["qkv"] == ["gemv", "dense", "panel", "panel", "dense"]


def test_a_partial_kernel_extends_past_the_last_measured_bucket():
    """The LM head is measured up to 128 rows: its larger buckets follow the last choice."""
    times = {"head": {"dense": [4, 4, 4, None, None], "onednn": [3, 3, 3, None, None],
                      "gemv": [1, None, None, None, None], "panel": [None, 2, 2, None, None]}}
    assert gs.decide(times)["head"] == ["gemv"] + ["panel"] * (N - 1)


def test_a_packed_partial_kernel_replaces_a_packed_layout_by_any_margin():
    """The panel GEMM 5% faster than oneDNN in every bucket oneDNN holds: no layout is added,
    so no 10% gain is asked for; 5% faster in only some of them: it would add one."""
    base = {"dense": [4, 4, 4, 4, 4], "onednn": [3, 2, 2, 2, 2],
            "gemv": [1, None, None, None, None]}
    everywhere = {"q": dict(base, panel=[None, 1.9, 1.9, 1.9, 1.9])}
    assert gs.decide(everywhere)["q"] == ["gemv"] + ["panel"] * (N - 1)
    partly = {"q": dict(base, panel=[None, 1.9, 1.9, 2.1, 2.1])}
    assert gs.decide(partly)["q"] == ["gemv"] + ["onednn"] * (N - 1)


def test_a_third_weight_layout_needs_a_real_gain():
    dense, gemv = [1, 1, 1, 2, 2], [0.9, None, None, None, None]
    onednn = [2, 2, 2, 1, 1]
    # the panel GEMM within 5% of oneDNN where oneDNN wins: one packed layout is enough
    near = {"q": {"dense": dense, "onednn": onednn, "gemv": gemv,
                  "panel": [None, 0.5, 0.5, 1.05, 1.05]}}
    assert gs.decide(near)["q"] == ["gemv"] + ["panel"] * (N - 1)
    # 50% slower there: both packed layouts earn their memory
    far = {"q": {"dense": dense, "onednn": onednn, "gemv": gemv,
                 "panel": [None, 0.5, 0.5, 1.5, 1.5]}}
    assert gs.decide(far)["q"] == ["gemv", "panel", "panel", "onednn", "onednn"]


def test_forced_plan_and_bad_names():
    assert gs.forced_plan("dense").kernels["mlp"] == ["dense"] * N
    assert gs.forced_plan("gemv").kernels["qkv"] == ["gemv"] + ["dense"] * (N - 1)
    assert gs.forced_plan("panel").kernels["head"] == ["dense"] + ["panel"] * (N - 2) + ["dense"]
    with pytest.raises(ValueError, match="GEMM kernel"):
        gs.forced_plan("mkl")


def test_choose_caches_an_undisturbed_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))  # this machine is shared
    calls = []

    def factory(kernel):
        def make(rows):
            calls.append((kernel, rows))
            return lambda: None
        return make

    factories = {p: {"dense": factory("dense"), "onednn": factory("onednn")}
                 for p in gs.PROJECTIONS}
    max_bucket = {p: N - 1 for p in gs.PROJECTIONS}
    plan = gs.choose("key-a", factories, max_bucket)
    assert plan.source == "measured" and set(plan.kernels) == set(gs.PROJECTIONS)
    assert {rows for _, rows in calls} == {probe for _, probe in gs.BUCKETS}
    stored = json.loads((tmp_path / "gemm-choice.json").read_text())
    assert stored["key-a"]["kernels"] == plan.kernels
    calls.clear()
    again = gs.choose("key-a", factories, max_bucket)
    assert again.source == "cached" and again.kernels == plan.kernels and not calls
    # a corrupt cache file is a miss, not an error
    (tmp_path / "gemm-choice.json").write_text("{not json")
    assert gs.choose("key-a", factories, max_bucket).source == "measured"


def test_disturbed_measurement_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", -1.0)  # everything counts as disturbed
    factories = {p: {"dense": lambda rows: (lambda: None)} for p in gs.PROJECTIONS}
    plan = gs.choose("key-b", factories, {p: 0 for p in gs.PROJECTIONS})
    assert plan.source == "measured, disturbed"
    assert plan.kernels["qkv"] == ["dense"] * N
    assert not (tmp_path / "gemm-choice.json").exists()


def test_engine_logs_and_uses_the_choice(tmp_path, monkeypatch, caplog):
    from kvserve import LLM, SamplingParams
    from kvserve.model.make_model import ensure_default_model

    model_dir = ensure_default_model()
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    logger = logging.getLogger("kvserve")  # does not propagate: attach caplog to it
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kvserve"):
            llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_threads=1)
    finally:
        logger.removeHandler(caplog.handler)
    plan = llm.engine.model.gemm_plan
    assert plan is not None and plan.source.startswith("measured")
    assert any("GEMM kernels" in r.getMessage() for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_cold_timing_evicts_before_every_timed_call():
    """With an evictor, every sample is one call right after an eviction (the warm-up and
    the first timing, which only size the samples, run without)."""
    log = []

    def factory(kernel):
        return lambda rows: (lambda: log.append(kernel))

    factories = {"qkv": {"dense": factory("dense"), "onednn": factory("onednn")}}
    times = gs.measure(factories, {"qkv": 2}, repeats=3, evict=lambda: log.append("evict"),
                       cold=[False, True, True])
    hot_bucket, log = log[:len(log) - 2 * 16], log[len(log) - 2 * 16:]
    assert "evict" not in hot_bucket and len(hot_bucket) > 16  # many calls per hot sample
    assert all(t is not None for k in ("dense", "onednn") for t in times["qkv"][k][:3])
    per_bucket = len(log) // 2
    for b in range(2):
        timed = log[b * per_bucket + 4:(b + 1) * per_bucket]  # after 2 warm-ups + 2 sizings
        assert all(timed[i] == "evict" and timed[i + 1] in ("dense", "onednn")
                   for i in range(0, len(timed), 2))
        assert len(timed) == 2 * 3 * 2  # 3 rounds x 2 kernels, one eviction + one call each


def test_weights_stream_past_half_the_last_level_cache():
    """Past half the cache with many rows; at a few rows (little K/V) past the cache."""
    assert gs.weights_stream(130, 256, 1) and not gs.weights_stream(120, 256, 1)
    assert not gs.weights_stream(130, 256, 0) and gs.weights_stream(257, 256, 0)
    # unknown size: the typical one
    assert gs.weights_stream(gs.UNKNOWN_L3_BYTES // 2 + 1, None, 2)
    assert not gs.weights_stream(gs.UNKNOWN_L3_BYTES // 2, None, 2)
    key = gs.cache_key("float32", 2, {"qkv": (8, 4)}, "x", cold=[False, True, True])
    assert key.endswith("|cold 011")
    assert "cold" not in gs.cache_key("float32", 2, {"qkv": (8, 4)}, "x", cold=[False] * 3)


def test_a_library_isa_cap_gets_its_own_cache_key(monkeypatch):
    """oneDNN reads its cap under the new name and the old one (DNNL_MAX_CPU_ISA): either one
    set changes its speed, so a choice measured under it is cached apart."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)
    plain = gs.cache_key("float32", 2, {"qkv": (8, 4)}, "x")
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.setenv(var, "AVX2")
        key = gs.cache_key("float32", 2, {"qkv": (8, 4)}, "x")
        assert key != plain and f"{var}=AVX2" in key
        monkeypatch.delenv(var)


def test_a_model_larger_than_the_cache_is_timed_cold(tmp_path, monkeypatch):
    """The engine times its kernels with the weights evicted where its weights stream from
    DRAM (here: a last-level cache made tiny), under a key of its own."""
    from kvserve import LLM
    from kvserve.model import decoder
    from kvserve.model.make_model import ensure_default_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))  # cache it whatever the load
    monkeypatch.setattr(decoder, "l3_cache_bytes", lambda: 4096)
    evictions = []
    real = gs.cache_evictor

    def counting(l3, *a, **k):
        run = real(l3, *a, **k)
        return lambda: (evictions.append(l3), run())

    monkeypatch.setattr(gs, "cache_evictor", counting)
    LLM(model=str(ensure_default_model()), dtype="float32", max_model_len=64, num_threads=1)
    assert evictions and set(evictions) == {4096}
    stored = json.loads((tmp_path / "gemm-choice.json").read_text())
    assert [k.endswith("|cold 11111") for k in stored] == [True]
