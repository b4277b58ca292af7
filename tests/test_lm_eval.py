"""lm-eval against a running `kvserve serve` (issue 13, acceptance 1).

lm-eval's `local-completions` backend scores loglikelihood tasks through /v1/completions with
`echo: true, logprobs: 1, max_tokens: 1` and batched token-id prompts. Here it scores a local
multiple-choice task and a local `loglikelihood_rolling` task (tests/data/lm_eval/, nothing
downloads) on the shipped trained model in float32, and the result must be what lm-eval's own
`hf` backend (transformers, the independent reference) gives on the same checkpoint: the same
accuracy, the same perplexities, and request by request the same log-likelihoods and greedy
flags.

The same comparison from the command line (docs/figures/accuracy.md):

    kvserve serve kvserve/assets/stdlib-coder --dtype float32 --served-model-name stdlib-coder
    HF_DATASETS_OFFLINE=1 lm_eval --model local-completions --model_args \\
        model=stdlib-coder,base_url=http://127.0.0.1:8000/v1/completions,\\
        tokenizer_backend=huggingface,tokenizer=kvserve/assets/stdlib-coder \\
        --batch_size 8 --tasks kvserve_stdlib_mc,kvserve_stdlib_ppl \\
        --include_path tests/data/lm_eval
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "kvserve" / "assets" / "stdlib-coder"
TASKS = ["kvserve_stdlib_mc", "kvserve_stdlib_ppl"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def lm_eval_offline():
    """lm-eval imported with the Hugging Face hubs off (the tasks read local JSONL)."""
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    try:
        import datasets
        import lm_eval
        from lm_eval.tasks import TaskManager

        datasets.config.HF_HUB_OFFLINE = True  # in case datasets was imported before
        yield lm_eval, TaskManager(include_path=str(REPO / "tests" / "data" / "lm_eval"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _evaluate(lm_eval, task_manager, model: str, model_args: dict) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=task_manager, batch_size=8, device="cpu",
                                   log_samples=True, bootstrap_iters=0)


def _per_request(samples: list[dict]) -> list:
    return [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_local_completions_scores_what_the_hf_backend_scores(lm_eval_offline, tmp_path,
                                                             monkeypatch):
    lm_eval, task_manager = lm_eval_offline
    monkeypatch.chdir(REPO)  # the task YAMLs name their data relative to the repository
    server = ServerProcess("stdlib-coder", [str(MODEL_DIR), "--dtype", "float32",
                                            "--served-model-name", "stdlib-coder",
                                            "--max-num-seqs", "16",
                                            "--max-num-batched-tokens", "2048"],
                           tmp_path, max_model_len=2048)
    try:
        # the reference runs while the server starts
        ref = _evaluate(lm_eval, task_manager, "hf",
                        {"pretrained": str(MODEL_DIR), "dtype": "float32"})
        server.wait_ready()
        ours = _evaluate(lm_eval, task_manager, "local-completions", {
            "model": "stdlib-coder", "base_url": f"{server.url}/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": str(MODEL_DIR),
            "max_retries": 1})
    finally:
        code = server.stop()
    assert code is None, server.log()[-3000:]

    mc_ref, mc = ref["results"]["kvserve_stdlib_mc"], ours["results"]["kvserve_stdlib_mc"]
    for metric in ("acc,none", "acc_norm,none"):
        assert mc[metric] == mc_ref[metric], (metric, mc[metric], mc_ref[metric])
    worst_mc = 0.0
    for got, want in zip(_per_request(ours["samples"]["kvserve_stdlib_mc"]),
                         _per_request(ref["samples"]["kvserve_stdlib_mc"]), strict=True):
        assert len(got) == len(want)
        for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
            assert abs(ll - ll_ref) <= 1e-4 and greedy == greedy_ref
            worst_mc = max(worst_mc, abs(ll - ll_ref))

    ppl_ref, ppl = ref["results"]["kvserve_stdlib_ppl"], ours["results"]["kvserve_stdlib_ppl"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(ppl[metric], ppl_ref[metric], rel_tol=1e-5), \
            (metric, ppl[metric], ppl_ref[metric])
    worst_ppl = 0.0
    for got, want in zip(_per_request(ours["samples"]["kvserve_stdlib_ppl"]),
                         _per_request(ref["samples"]["kvserve_stdlib_ppl"]), strict=True):
        got, want = (x[0] if isinstance(x, list) else x for x in (got, want))
        assert abs(got - want) <= 1e-3, (got, want)
        worst_ppl = max(worst_ppl, abs(got - want))
    print(f"lm-eval hf vs local-completions: largest |loglikelihood difference| "
          f"{worst_mc:.2e} (multiple choice), {worst_ppl:.2e} (rolling);",
          {m: (mc_ref[m], mc[m]) for m in ("acc,none", "acc_norm,none")},
          {m: (ppl_ref[m], ppl[m]) for m in ("word_perplexity,none", "byte_perplexity,none",
                                              "bits_per_byte,none")})
