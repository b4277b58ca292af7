"""The differential guards on the quantized models users run (issue 64): the embedded SmolLM2
Q4_1 file and a Q4_K_M-style mix of it (ffn_down in Q4_K / Q6_K, test_quant_kquants'
`_q4_k_m_like`), with deterministic inference on.

tests/test_differential.py runs its guards on a float reference model; on a quantized model a
token's logits also depend on which kernels its step's row count picks (the integer kernels
against MKL on a dequantized copy, SDPA's prefill against the paged decode kernel), and the
int8 activation quantization turns a last-bit difference into a visible one: there the prefix
cache changed greedy answers. With `deterministic=True` every guard must hold bit for bit
here too: prefix caching, a step budget that cuts prompts into other chunks and batches
(chunk sizes, batch composition), preemption by swap, storage tiers, speculative decoding,
n > 1 and aborts (in every workload). The workloads are test_differential's (the same seed),
fewer of them: a quantized model's run costs more than the tiny float one's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from differential import RunResult, Tiers, Workload, compare, make_llm, run
from hypothesis import given, seed, settings
from test_differential import (SEED, SETTINGS, _blocks_for_longest, _longer_outputs,
                               _no_source_constants, workloads)  # noqa: F401 (a fixture)

EXAMPLES = 5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["smollm2-q4_1", "q4_k_m-like"])
def quant_model(request, tmp_path_factory) -> Path:
    from gguf_files import requantize_mixed, smollm2_path
    from test_quant_kquants import _q4_k_m_like

    from kvserve.kernels.cpu import qgemv

    if qgemv.load() is None:
        pytest.skip("no C++ compiler: no quantized kernels")
    if request.param == "smollm2-q4_1":
        return smollm2_path()
    return requantize_mixed(smollm2_path(), tmp_path_factory.mktemp("q4km") / "q4_k_m.gguf",
                            _q4_k_m_like)


def _guard(model: Path, name: str, w: Workload, off: dict, on: dict
           ) -> tuple[RunResult, RunResult]:
    """The workload with `off`, then with `on` (both deterministic): no output may differ."""
    want = _run(model, w, off)
    got = _run(model, w, on)
    diffs = compare(want, got)
    assert not diffs, (f"{name} changed {len(diffs)} outputs on {model.name}:\n"
                       + "\n".join(diffs) + "\nworkload:\n" + w.describe())
    return want, got


def _run(model: Path, w: Workload, engine: dict) -> RunResult:
    engine = dict(engine)
    tiers = engine.pop("tiers", None)
    llm = make_llm(model, w, tiers=tiers, deterministic=True, **engine)
    try:
        return run(llm, w)
    finally:
        llm.engine.shutdown()
        if tiers is not None:
            tiers.cleanup()


def _examples():
    return settings(SETTINGS, max_examples=EXAMPLES)


def test_prefix_caching_does_not_change_quantized_outputs(quant_model):
    hits = []

    @seed(SEED)
    @_examples()
    @given(workloads())
    def check(w: Workload) -> None:
        _, got = _guard(quant_model, "prefix caching", w, {"prefix_caching": False}, {})
        hits.append(got.stats.hit_tokens["device"])

    check()
    assert all(h > 0 for h in hits), hits


def test_step_budget_does_not_change_quantized_outputs(quant_model):
    """The workload's small step budget (prompts in chunks of 16-64 tokens beside the
    decodes of others) against one step per request's whole prompt, one request at a time:
    other chunk sizes and other batch neighbours, the same bits."""
    @seed(SEED)
    @_examples()
    @given(workloads())
    def check(w: Workload) -> None:
        _guard(quant_model, "the step budget", w,
               {"max_num_batched_tokens": 512, "max_num_seqs": 1}, {})

    check()


def test_swap_and_tiers_do_not_change_quantized_outputs(quant_model):
    """Preemption by swap against recompute (a pool just big enough for the longest request),
    and a host + disk tier under the pool against none."""
    swapped, tier_hits = [], []

    @seed(SEED)
    @_examples()
    @given(workloads())
    def check(w: Workload) -> None:
        longer = _longer_outputs(w)
        longer = dataclasses.replace(longer, pool_blocks=_blocks_for_longest(longer))
        _, got = _guard(quant_model, "swap preemption", longer,
                        {"preemption_mode": "recompute"}, {"preemption_mode": "swap"})
        swapped.append(got.stats.swap["swapped_in"])
        _, got = _guard(quant_model, "tiers (host+disk)", w, {},
                        {"tiers": Tiers("host+disk")})
        tier_hits.append(sum(got.stats.hit_tokens[s] for s in ("host", "disk")))

    check()
    assert any(s > 0 for s in swapped), swapped
    assert any(h > 0 for h in tier_hits), tier_hits


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_does_not_change_quantized_outputs(quant_model, method):
    drafted = []

    @seed(SEED)
    @_examples()
    @given(workloads())
    def check(w: Workload) -> None:
        w = _longer_outputs(w)
        w = dataclasses.replace(w, pool_blocks=max(w.pool_blocks, _blocks_for_longest(w)))
        spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
        _, got = _guard(quant_model, f"speculation ({method})", w, {},
                        {"speculative_config": spec})
        drafted.append(got.stats.spec_decode.get("num_draft_tokens", 0))

    check()
    assert any(d > 0 for d in drafted), drafted
