"""Held-out perplexity (`kvserve bench perplexity` over kvserve.eval): the engine's equals
transformers' on the same weights within 1e-3 relative (float32) for every architecture; the
baselines and the held-out split follow their stated rules."""

from __future__ import annotations

import hashlib
import json
import math
import platform
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.bench import perplexity
from kvserve.entrypoints.cli import main as cli_main
from kvserve.eval.heldout import is_heldout, stdlib_files, stdlib_root
from kvserve.eval.perplexity import NLL, relative_difference, unigram_nll, windows
from kvserve.model_loader.make_model import TRAINED_MODEL_DIR as TRAINED

TEXTS = {
    "a.txt": "def add(a, b):\n    return a + b\n\n" * 30,
    "b.txt": "The quick brown fox jumps over the lazy dog. " * 40 + "\nÉté: ça marche.\n",
}


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("texts")
    for name, text in TEXTS.items():
        (root / name).write_text(text, encoding="utf-8")
    return [root / name for name in TEXTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_perplexity_equals_transformers(arch, hf_checkpoints, text_files):
    llm = LLM(model=str(hf_checkpoints[arch]), dtype="float32", max_model_len=129,
              max_num_batched_tokens=96)
    results = perplexity.evaluate(llm, text_files, max_tokens=700, context=128,
                                  compare_transformers=True, use_tqdm=False)
    llm.engine.shutdown()
    engine, reference = results["kvserve"], results["transformers"]
    assert engine.tokens == reference.tokens > 600
    assert relative_difference(engine.perplexity, reference.perplexity) <= 1e-3
    assert "rel. diff" in perplexity.table(results)


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: transformers gets the resolved one
def test_the_command_line_scores_what_transformers_scores(hf_checkpoints, text_files, tmp_path,
                                                          dtype):
    out = tmp_path / "ppl.json"
    status = cli_main(["bench", "perplexity", str(hf_checkpoints["llama"]), "--dtype", dtype,
                       "--files", *map(str, text_files), "--max-tokens", "300", "--context",
                       "64", "--compare-transformers", "--disable-tqdm", "--output-json",
                       str(out)])
    assert status == 0
    res = json.loads(out.read_text())["results"]
    assert res["kvserve"]["tokens"] == res["transformers"]["tokens"] > 250
    assert relative_difference(res["kvserve"]["perplexity"],
                               res["transformers"]["perplexity"]) <= 1e-3


def test_baselines_run_through_the_same_windows(hf_checkpoints, text_files):
    llm = LLM(model=str(hf_checkpoints["qwen2"]), dtype="float32", max_model_len=101)
    results = perplexity.evaluate(llm, text_files[:1], max_tokens=300, context=100,
                                  baselines=True, train_files=text_files[1:], use_tqdm=False)
    llm.engine.shutdown()
    assert set(results) == {"kvserve", "unigram (train split)", "random-weight (kvserve)"}
    assert len({r.tokens for r in results.values()}) == 1
    # transformers' own init (std 0.02) is near-uniform: perplexity close to the vocabulary
    assert 0.5 * 512 < results["random-weight (kvserve)"].perplexity < 2 * 512


def test_unigram_is_add_one_smoothed():
    got = unigram_nll([5, 5, 7], vocab_size=10, wins=[[1, 5, 7, 9]])
    expected = -(math.log(3 / 13) + math.log(2 / 13) + math.log(1 / 13))
    assert got.tokens == 3 and math.isclose(got.total, expected)
    assert math.isclose(NLL(got.total, 3).perplexity, math.exp(expected / 3))


def test_windows_do_not_overlap():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # [8] predicts nothing


def test_heldout_split_follows_the_stated_rule():
    root = stdlib_root()
    held, train = stdlib_files("heldout"), stdlib_files("train")
    assert held and train and not set(held) & set(train)
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.09
    record = json.loads((TRAINED / "loss_curve.json").read_text())
    if record.get("python") == platform.python_version():  # the corpus the model was trained on
        corpus = record["corpus"]
        assert (len(held), len(train)) == (corpus["held_out_files"], corpus["train_files"])
    for path in held + train:
        rel = path.relative_to(root).as_posix()
        assert not {"site-packages", "test", "tests"} & set(rel.split("/")[:-1])
        by_hex = int(hashlib.sha256(rel.encode()).hexdigest()[:16], 16) % 1000 < 50
        assert is_heldout(rel) == by_hex == (path in held)
