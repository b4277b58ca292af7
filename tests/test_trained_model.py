"""The committed `stdlib-coder` model (no longer the default: kept as the asset that shows training
reproduces): its files, that kvserve and transformers agree on it, that its held-out loss is what
training recorded, and that scripts/train_model.py reproduces the recorded loss curve (a
shortened run, same seed)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.model_loader.make_model import TRAINED_MODEL_DIR
from kvserve.tokenizer.train import BOS_TOKEN_ID, CHATML_TEMPLATE, EOS_TOKEN_ID, SPECIAL_TOKENS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_model.py"
SHORT_RUN_STEPS = 5  # the curve is logged at steps 1, 5, 10, ...: compare the first two
TOLERANCE = 0.02  # relative, on each recorded train loss


def _train_module():
    spec = importlib.util.spec_from_file_location("train_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_model", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tm():
    return _train_module()


@pytest.fixture(scope="module")
def record(tm) -> dict:
    return json.loads((TRAINED_MODEL_DIR / tm.CURVE_FILE).read_text())


def _same_python(record: dict) -> None:
    """The corpus is this interpreter's standard library: another version is another corpus."""
    if record["python"] != platform.python_version():
        pytest.skip(f"the recorded run used Python {record['python']}'s stdlib; this is "
                    f"{platform.python_version()}")


def test_committed_files_and_size():
    names = {p.name for p in TRAINED_MODEL_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "loss_curve.json", "README.md"} <= names
    total = sum(p.stat().st_size for p in TRAINED_MODEL_DIR.iterdir())
    assert total <= 21 * 1024 * 1024, f"{total:,} bytes"
    cfg = json.loads((TRAINED_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["max_position_embeddings"] == 2048 and cfg["tie_word_embeddings"] is True
    tok = json.loads((TRAINED_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == CHATML_TEMPLATE
    assert tok["eos_token"] == SPECIAL_TOKENS[EOS_TOKEN_ID]
    gen = json.loads((TRAINED_MODEL_DIR / "generation_config.json").read_text())
    assert gen["bos_token_id"] == BOS_TOKEN_ID


def test_kvserve_and_transformers_agree_on_greedy_tokens():
    transformers = pytest.importorskip("transformers")
    from kvserve import LLM, SamplingParams

    prompts = ["import os\n\n\ndef walk(path):\n", "class Queue:\n    def __init__(self):\n"]
    llm = LLM(model=str(TRAINED_MODEL_DIR), dtype="float32", max_model_len=256, block_size=16)
    ours = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(TRAINED_MODEL_DIR,
                                                           dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=BOS_TOKEN_ID)
        assert got == ref[0, ids.shape[1]:].tolist()


def test_held_out_loss_matches_the_recorded_one(tm, record):
    """The committed bf16 weights on the held-out windows of the last periodic evaluation."""
    _same_python(record)
    torch.set_num_threads(2)
    cfg = record["config"]
    _, _, held_texts = tm.load_corpus()
    held = tm.windows(tm.encode_stream(TRAINED_MODEL_DIR, held_texts), cfg["seq_len"])
    subset = tm.eval_subset(held, cfg["eval_windows"])
    loss = tm.evaluate(tm.load_hf_weights(TRAINED_MODEL_DIR), subset)
    recorded = [r["held_out_loss"] for r in record["curve"] if "held_out_loss" in r][-1]
    assert abs(loss - recorded) <= TOLERANCE * recorded, (loss, recorded)
    assert loss < record["curve"][0]["train_loss"] - 2.0  # far below the untrained model's


def test_shortened_training_reproduces_the_recorded_curve(tmp_path, record):
    """The first steps of the same script, seed and schedule (tokenizer trained afresh) give
    the recorded train losses within 2% and the committed tokenizer byte for byte."""
    _same_python(record)
    cfg = record["config"]
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "model"),
           "--work", str(tmp_path / "work"), "--stop-after", str(SHORT_RUN_STEPS),
           "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]),
           "--batch-size", str(cfg["batch_size"]), "--seq-len", str(cfg["seq_len"]),
           "--lr", str(cfg["lr"]), "--eval-every", str(cfg["eval_every"]),
           "--threads", str(cfg["threads"])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=540)
    assert ((tmp_path / "model" / "tokenizer.json").read_bytes()
            == (TRAINED_MODEL_DIR / "tokenizer.json").read_bytes())
    short = json.loads((tmp_path / "work" / "loss_curve.json").read_text())
    assert ({k: v for k, v in short["corpus"].items() if k != "root"}
            == {k: v for k, v in record["corpus"].items() if k != "root"})
    got = {r["step"]: r["train_loss"] for r in short["curve"]}
    want = {r["step"]: r["train_loss"] for r in record["curve"] if r["step"] in got}
    assert set(want) == set(got) and max(got) == SHORT_RUN_STEPS
    for step, loss in sorted(want.items()):
        assert abs(got[step] - loss) <= TOLERANCE * loss, (step, got[step], loss)
