"""GEMM kernel choice by measurement (kvserve/layers/gemm_select.py): the decision rule, the
per-CPU cache, and that the engine runs with what was chosen.

Logits under every kernel choice (all dense, all oneDNN, measured, and a plan mixing kernels
across row buckets) are checked against transformers in test_model_parity.py."""

from __future__ import annotations

import json
import logging

import pytest

from kvserve.layers import gemm_select as gs

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


def _fake_timed(monkeypatch, table, calls=None):
    """Factories whose runs take table[kernel][bucket] seconds, as `measure` times them (no
    real timing: time_once returns what the run says); `calls` collects (projection, kernel,
    bucket) per factory call."""
    monkeypatch.setattr(gs, "time_once", lambda run, n: run())

    def factory(proj, kernel):
        def make(rows):
            b = gs.bucket_of(rows)
            if calls is not None:
                calls.append((proj, kernel, b))
            return lambda: table[kernel][b]
        return make

    return {p: {k: factory(p, k) for k in table} for p in gs.PROJECTIONS}


def _measured(calls):
    return sorted({(p, b) for p, _, b in calls})


MAX_BUCKET = {p: N - 1 for p in gs.PROJECTIONS}


def test_a_disturbed_measurement_is_cached_and_refined_a_few_cells_at_a_time(
        tmp_path, monkeypatch):
    """Measured on a busy machine: cached with every cell marked, used at the next start
    without measuring it all again; on a quiet machine the cheapest disturbed cells (one here:
    no budget) are measured again, their faster figures kept, and the choice made again."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    table = {"dense": [2.0] * N, "onednn": [1.0] * N}
    calls = []
    factories = _fake_timed(monkeypatch, table, calls)
    monkeypatch.setattr(gs, "DISTURBED_CORES", -1.0)  # everything counts as disturbed
    plan = gs.choose("key-b", factories, MAX_BUCKET)
    assert plan.source == "measured, disturbed" and plan.kernels["qkv"] == ["onednn"] * N
    assert len(_measured(calls)) == len(gs.PROJECTIONS) * N
    stored = json.loads((tmp_path / "gemm-choice.json").read_text())["key-b"]
    assert stored["kernels"] == plan.kernels
    assert stored["disturbed"] == {p: [1] * N for p in gs.PROJECTIONS}

    # next start, still busy: the cached plan as it is, nothing measured
    monkeypatch.setattr(gs, "_quiet", lambda: False)
    calls.clear()
    again = gs.choose("key-b", factories, MAX_BUCKET)
    assert again.source == "cached, disturbed" and again.kernels == plan.kernels and not calls

    # a quiet start: one cell (the budget is spent by the first) measured again, quiet now
    monkeypatch.setattr(gs, "_quiet", lambda: True)
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))
    monkeypatch.setattr(gs, "REFINE_BUDGET_S", 0.0)
    table["dense"] = [0.5] * N  # dense was slow only because the machine was busy
    calls.clear()
    refined = gs.choose("key-b", factories, MAX_BUCKET)
    assert refined.source == "cached, refined 1 disturbed cell"
    (cell,) = _measured(calls)
    stored = json.loads((tmp_path / "gemm-choice.json").read_text())["key-b"]
    assert sum(n for ns in stored["disturbed"].values() for n in ns) == \
        len(gs.PROJECTIONS) * N - 1
    assert stored["disturbed"][cell[0]][cell[1]] == 0
    assert stored["times_us"][cell[0]]["dense"][cell[1]] == 0.5e6  # the faster figure kept
    assert stored["times_us"][cell[0]]["onednn"][cell[1]] == 1e6

    # a whole budget: every disturbed cell at once, then nothing is left to measure
    monkeypatch.setattr(gs, "REFINE_BUDGET_S", float("inf"))
    calls.clear()
    done = gs.choose("key-b", factories, MAX_BUCKET)
    assert len(_measured(calls)) == len(gs.PROJECTIONS) * N - 1 and cell not in _measured(calls)
    assert done.kernels == {p: ["dense"] * N for p in gs.PROJECTIONS}  # decided again
    calls.clear()
    last = gs.choose("key-b", factories, MAX_BUCKET)
    assert last.source == "cached" and last.kernels == done.kernels and not calls


def test_a_cell_disturbed_again_and_again_is_kept_as_it_is(tmp_path, monkeypatch):
    """On a machine that is busy whenever it measures, each cell is measured again at most
    MAX_DISTURBED - 1 times, then the plan is settled: starts stop measuring for good."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    calls = []
    factories = _fake_timed(monkeypatch, {"dense": [2.0] * N, "onednn": [1.0] * N}, calls)
    monkeypatch.setattr(gs, "DISTURBED_CORES", -1.0)
    monkeypatch.setattr(gs, "_quiet", lambda: True)  # quiet before, busy during
    monkeypatch.setattr(gs, "REFINE_BUDGET_S", float("inf"))
    gs.choose("key-c", factories, MAX_BUCKET)
    starts = 0
    while True:
        calls.clear()
        plan = gs.choose("key-c", factories, MAX_BUCKET)
        if not calls:
            break
        starts += 1
        assert plan.source.endswith("(disturbed again)")
    assert starts == gs.MAX_DISTURBED - 1 and plan.source == "cached"


def test_remeasure_measures_everything_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))
    table = {"dense": [2.0] * N, "onednn": [1.0] * N}
    calls = []
    factories = _fake_timed(monkeypatch, table, calls)
    assert gs.choose("key-d", factories, MAX_BUCKET).kernels["o"] == ["onednn"] * N
    table["dense"] = [0.5] * N
    calls.clear()
    assert gs.choose("key-d", factories, MAX_BUCKET).source == "cached" and not calls
    plan = gs.choose("key-d", factories, MAX_BUCKET, remeasure=True)
    assert plan.source == "measured" and plan.kernels["o"] == ["dense"] * N
    assert len(_measured(calls)) == len(gs.PROJECTIONS) * N
    assert gs.load_cached("key-d").kernels == plan.kernels  # and cached for the next start


def test_a_plan_cached_for_another_shape_or_machine_is_not_used(tmp_path, monkeypatch):
    """The key names the CPU, its flags, torch, threads, dtype and every weight shape: a
    cache written under another one is a miss (measured), never reused."""
    from kvserve.kernels.cpu import cpu_features

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))
    calls = []
    factories = _fake_timed(monkeypatch, {"dense": [1.0] * N, "onednn": [2.0] * N}, calls)
    shapes = {"qkv": (192, 64), "o": (64, 64), "mlp": (256, 64), "down": (64, 128),
              "head": (512, 64)}
    key = gs.cache_key("float32", 2, shapes, "2.x")
    gs.choose(key, factories, MAX_BUCKET)
    others = [gs.cache_key("float32", 2, dict(shapes, mlp=(512, 64)), "2.x"),
              gs.cache_key("float32", 1, shapes, "2.x"),
              gs.cache_key("bfloat16", 2, shapes, "2.x"),
              gs.cache_key("float32", 2, shapes, "2.y")]
    real = cpu_features.cpu_info()
    monkeypatch.setattr(gs, "cpu_info", lambda: type(real)(**{**vars(real),
                                                              "model_name": "Another CPU"}))
    others.append(gs.cache_key("float32", 2, shapes, "2.x"))
    assert len(set(others) | {key}) == len(others) + 1
    for other in others:
        assert gs.load_cached(other) is None
        calls.clear()
        assert gs.choose(other, factories, MAX_BUCKET).source == "measured" and calls


def test_engine_logs_and_uses_the_choice(tmp_path, monkeypatch, caplog):
    from kvserve import LLM, SamplingParams
    from kvserve.model_loader.make_model import ensure_default_model

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


def test_the_engine_reuses_the_cached_choice_unless_told_to_remeasure(tmp_path, monkeypatch):
    """LLM() measures once per machine and model shape; the next one reads the cache;
    remeasure_kernels=True (--remeasure-kernels) measures again."""
    from kvserve import LLM
    from kvserve.model_loader.make_model import ensure_default_model

    model_dir = str(ensure_default_model())
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))
    args = dict(model=model_dir, dtype="float32", max_model_len=64, num_threads=1)
    sources = [LLM(**args).engine.model.gemm_plan.source,
               LLM(**args).engine.model.gemm_plan.source,
               LLM(**args, remeasure_kernels=True).engine.model.gemm_plan.source]
    assert sources == ["measured", "cached", "measured"]


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
def test_remeasure_kernels_flag(command):
    from kvserve.entrypoints.cli import build_parser, engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args([command, "--remeasure-kernels"]))[
        "remeasure_kernels"] is True
    assert engine_kwargs(parser.parse_args([command]))["remeasure_kernels"] is False


def _causal_attn(scale):
    import torch.nn.functional as F

    def attend(layer_idx, q, k, v):
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), is_causal=True, scale=scale,
                                              enable_gqa=True).transpose(0, 1)
    return attend


def test_a_cached_plan_packs_weights_that_give_the_dense_logits(tmp_path, monkeypatch):
    """A plan read from the cache that mixes every kernel this machine has across the row
    buckets (oneDNN's, the panel GEMM's and the GEMV's layouts packed from it) gives the
    logits of dense F.linear at a row count in every bucket, within float rounding."""
    import torch

    from kvserve.worker.model_build import load_model
    from kvserve.model_loader.make_model import ensure_default_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))
    path = ensure_default_model()
    dense, config = load_model(path, "float32", pack_weights=False)
    measured = load_model(path, "float32")[0].gemm_plan
    kinds = [k for k in gs.KERNELS if k in measured.times_us["qkv"]]
    per_bucket = [[k for k in kinds if gs.offered(k, b)] for b in range(N)]
    mixed = {p: [per_bucket[b][(b + i) % len(per_bucket[b])] for b in range(N)]
             for i, p in enumerate(gs.PROJECTIONS)}
    data = json.loads((tmp_path / "gemm-choice.json").read_text())
    (key,) = data
    data[key]["kernels"] = mixed
    (tmp_path / "gemm-choice.json").write_text(json.dumps(data))
    packed = load_model(path, "float32")[0]
    assert packed.gemm_plan.source == "cached" and packed.gemm_plan.kernels == mixed
    for b, (limit, probe) in enumerate(gs.BUCKETS):
        t = min(probe + 3, int(limit)) if limit != float("inf") else 600
        ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(b))
        pos = torch.arange(t) % config.max_position_embeddings
        with torch.inference_mode():
            want, got = (m.compute_logits(m(ids, pos, _causal_attn(config.attention_scale)))
                         for m in (dense, packed))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


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
    # a field of its own, not the last one: a library's instruction-set cap in the environment
    # (cpu_features.isa_cap_env, as a suite run emulating an AVX2-only CPU sets) comes after it
    assert "cold 011" in key.split("|")
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
    from kvserve.models import decoder
    from kvserve.model_loader.make_model import ensure_default_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gs, "DISTURBED_CORES", float("inf"))  # cache it whatever the load
    monkeypatch.setattr(gs, "l3_cache_bytes", lambda: 4096)
    evictions = []
    real = gs.cache_evictor

    def counting(l3, *a, **k):
        run = real(l3, *a, **k)
        return lambda: (evictions.append(l3), run())

    monkeypatch.setattr(gs, "cache_evictor", counting)
    LLM(model=str(ensure_default_model()), dtype="float32", max_model_len=64, num_threads=1)
    assert evictions and set(evictions) == {4096}
    stored = json.loads((tmp_path / "gemm-choice.json").read_text())
    assert [("cold 11111" in k.split("|")) for k in stored] == [True]  # (as above)
