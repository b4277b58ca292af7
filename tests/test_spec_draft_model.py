"""Speculative decoding with a draft model (speculative_config method "draft_model",
kvserve/spec/draft_model.py).

The reference is the same engine with speculation off (as in tests/test_spec_decode.py):
greedy outputs equal token for token, the scheduler/KV invariants hold after every step and
every block is back in the pool at the end (helpers.generate_checked), and no request's draft
KV outlives it. A target drafting for itself must have (nearly) every draft accepted, which
checks the drafter's own dense attention (GQA, sliding windows, soft-capping) against the
engine's paged attention; a truncated copy of the target (one of its two layers) drafts less
well but must still leave the outputs unchanged. Sampled requests: the first tokens' joint
distribution with drafting equals the one without (a chi-square test over many seeds).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import generate_checked, random_prompts, save_random_checkpoint
from test_spec_decode import smollm2_reference  # noqa: F401 (a fixture: SmolLM2 unspeculated)

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.spec.config import DRAFT_MODEL_BATCH_LIMIT, load_speculative_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _draft(path, k: int = 3, **kw) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random Llama (2 layers, vocabulary 512) whose greedy continuation depends on the
    whole context."""
    from conftest import _hf_config

    return save_random_checkpoint(_hf_config("llama"), tmp_path_factory.mktemp("draft") / "l")


@pytest.fixture(scope="module")
def truncated_dir(llama_dir, tmp_path_factory):
    """The Llama's first layer alone (its embeddings, norm and head kept): another model
    with the same tokenizer, whose drafts the target rejects part of the time."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "l1"
    shutil.copytree(llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    for f in out.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(f).items() if ".layers.1." not in k}
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def _prompts() -> list[dict]:
    motif = [11, 12, 13, 14, 15, 16, 17]
    ids = [motif * 6, [40, 41, 42] * 10 + [7, 8], *random_prompts([30, 9, 70], 512, seed=3)]
    return [{"prompt_token_ids": p} for p in ids]


def _run(path, spec, params=GREEDY, prompts=None, **kw):
    llm = LLM(model=str(path), speculative_config=spec, seed=0, **kw)
    outs = generate_checked(llm, prompts or _prompts(), params)
    spec_ = llm.engine.scheduler.spec
    if spec_ is not None and spec.get("method") == "draft_model":
        assert spec_.drafter.caches == {}, "a finished request's draft KV was kept"
    return outs, llm.engine.stats()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _acceptance(stats) -> float:
    c = stats.spec_decode
    assert c["num_draft_tokens"] > 0, c
    return c["num_accepted_tokens"] / c["num_draft_tokens"]


# -- config and refusals -----------------------------------------------------------------------
def test_config_keys_and_defaults(llama_dir):
    cfg = load_speculative_config(json.dumps(_draft(llama_dir, quantization="none",
                                                    max_model_len=128)))
    assert (cfg.model, cfg.quantization, cfg.max_model_len) == (str(llama_dir), "none", 128)
    assert cfg.disable_by_batch_size == DRAFT_MODEL_BATCH_LIMIT
    assert load_speculative_config(_draft(llama_dir, disable_by_batch_size=64)
                                   ).disable_by_batch_size == 64
    with pytest.raises(ValueError, match="needs \"model\""):
        load_speculative_config({"method": "draft_model"})
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(speculative_config=_draft(llama_dir / "nope"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_speculative_config(_draft(llama_dir, quantization="int3"))
    with pytest.raises(ValueError, match="max_model_len must be a positive"):
        load_speculative_config(_draft(llama_dir, max_model_len=0))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prompt_lookup_min'\]"):
        load_speculative_config(_draft(llama_dir, prompt_lookup_min=2))


def test_refuses_a_draft_of_another_vocabulary(llama_dir, tmp_path):
    from kvserve.model_loader.make_model import make_model

    other = make_model(tmp_path / "tiny", arch="llama", size="tiny")  # vocabulary 2048
    with pytest.raises(ValueError, match=r"vocabulary \(2048 tokens\) differs from the "
                                         r"target's \(512\)"):
        LLM(model=str(llama_dir), speculative_config=_draft(other))
    # the same size, another token -> id map: two tokens' ids swapped
    swapped = tmp_path / "swapped"
    shutil.copytree(llama_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        LLM(model=str(llama_dir), speculative_config=_draft(swapped))


def test_refuses_an_mla_draft(tmp_path):
    from kvserve.model_loader.make_model import make_model

    target = make_model(tmp_path / "llama", arch="llama", size="tiny")
    mla = make_model(tmp_path / "deepseek", arch="deepseek_v2", size="tiny")
    with pytest.raises(ValueError, match=r"draft model \(DeepseekV2ForCausalLM\) uses MLA"):
        LLM(model=str(target), speculative_config=_draft(mla))


# -- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["prefix_caching", "chunked", "recompute"])
def test_target_as_its_own_draft(llama_dir, case):
    """Every draft the target makes for itself is its own greedy token: nearly all accepted
    (the dense draft attention and the paged one round differently, so not all need be)."""
    from helpers import kv_bytes_per_token

    kw = {"prefix_caching": {},
          "chunked": {"max_num_batched_tokens": 16, "max_model_len": 256},
          "recompute": {"block_size": 4, "preemption_mode": "recompute",
                        "kv_cache_memory_bytes": 30 * 4 * kv_bytes_per_token(llama_dir)}}[case]
    prompts = _prompts() * 2 if case == "prefix_caching" else None
    spec = _draft(llama_dir, disable_by_batch_size=64)
    ref, _ = _run(llama_dir, None, prompts=prompts, **kw)
    outs, stats = _run(llama_dir, spec, prompts=prompts, **kw)
    assert _ids(outs) == _ids(ref)
    assert _acceptance(stats) > 0.95, stats.spec_decode
    if case == "recompute":
        assert stats.num_preemptions > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == \
        stats.spec_decode["num_accepted_tokens"]
    assert sum(o.metrics.num_draft_tokens for o in outs) == \
        stats.spec_decode["num_draft_tokens"]


def test_another_draft_model(llama_dir, truncated_dir):
    ref, _ = _run(llama_dir, None)
    outs, stats = _run(llama_dir, _draft(truncated_dir, k=2, disable_by_batch_size=64,
                                         acceptance_floor=0.0))
    assert _ids(outs) == _ids(ref)
    assert 0.0 < _acceptance(stats) < 0.95, stats.spec_decode


def test_default_batch_limit_turns_drafting_off(llama_dir):
    """With more running requests than disable_by_batch_size (the default) nobody drafts."""
    prompts = _prompts()[:4] * 2  # 8 requests at once
    ref, _ = _run(llama_dir, None, prompts=prompts)
    outs, stats = _run(llama_dir, _draft(llama_dir), prompts=prompts)
    assert _ids(outs) == _ids(ref)
    # drafting only once the batch has shrunk under the limit: fewer verifications than steps
    assert stats.spec_decode["num_drafts"] < 8 * GREEDY.max_tokens / 4


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory):
    """Mistral with a window of 8 on every layer, and Gemma 2 (soft-capped attention and
    logits, alternate sliding layers)."""
    import transformers
    from conftest import DECODE_COMMON, _hf_config

    root = tmp_path_factory.mktemp("draft_windows")
    return {
        "window": save_random_checkpoint(transformers.MistralConfig(
            **DECODE_COMMON, tie_word_embeddings=False, rope_theta=1e4, sliding_window=8),
            root / "mistral_window"),
        "gemma2": save_random_checkpoint(_hf_config("gemma2"), root / "gemma2"),
    }


@pytest.mark.parametrize("case", ["window", "gemma2"])
def test_windowed_and_softcapped_models_draft_for_themselves(window_dirs, case):
    path = window_dirs[case]
    kw = {"block_size": 4}
    ref, _ = _run(path, None, **kw)
    outs, stats = _run(path, _draft(path, disable_by_batch_size=64), **kw)
    assert _ids(outs) == _ids(ref)
    assert _acceptance(stats) > 0.95, stats.spec_decode


# -- sampling ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharp_dir(llama_dir, tmp_path_factory):
    """The Llama with its LM head times 8: peaked distributions at temperature 1 (the random
    model's own are nearly flat, so greedy drafts would almost never be accepted)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "sharp"
    shutil.copytree(llama_dir, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        tensors["lm_head.weight"] *= 8.0
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def test_sampled_distribution_is_kept(sharp_dir):
    """400 seeded requests at temperature 1: the (second, third) output tokens, which the
    first verification decides, are distributed as without speculation (a chi-square test
    of the two runs' counts over the pairs drawn at least 8 times in all, the rest pooled).
    Two requests at a time: a step's drafted rows are limited by the one-call decode's rows
    (Speculator.draft_rows)."""
    from scipy.stats import chi2_contingency

    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i)
              for i in range(400)]
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17] * 3}] * len(params)
    counts = []
    for spec in (None, _draft(sharp_dir, k=2, disable_by_batch_size=1000,
                              acceptance_floor=0.0)):
        llm = LLM(model=str(sharp_dir), speculative_config=spec, seed=0, max_num_seqs=2)
        outs = generate_checked(llm, prompts, params)
        counts.append([tuple(o.outputs[0].token_ids[1:3]) for o in outs])
        if spec is not None:
            counters = llm.engine.stats().spec_decode
            assert counters["num_drafts"] >= 300 and counters["num_accepted_tokens"] > 100, \
                counters
    assert counts[0] != counts[1]  # the draws differ (drafting consumes randomness)...
    pairs = {p for run in counts for p in run}
    common = sorted(p for p in pairs if sum(run.count(p) for run in counts) >= 8)
    assert len(common) >= 5
    table = [[run.count(p) for p in common] + [sum(1 for x in run if x not in common)]
             for run in counts]
    # ... but not their distribution
    assert chi2_contingency(torch.tensor(table).numpy()).pvalue > 1e-3, table


# -- SmolLM2 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("quantization", [None, "none"])
def test_smollm2_drafts_for_itself(smollm2_reference, quantization):
    """SmolLM2 (its Q4_1 GGUF) drafted by itself, in its own block format or dequantized to
    float32 (another model numerically): the same tokens and logprobs as without."""
    from gguf_files import smollm2_path

    prompts, params, expected, logprobs = smollm2_reference
    llm = LLM(seed=0, max_model_len=4096, deterministic=True, speculative_config=_draft(
        smollm2_path(), k=4, quantization=quantization))
    outs = generate_checked(llm, prompts, params)
    assert _ids(outs) == expected
    assert [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs] == logprobs
    stats = llm.engine.stats()
    assert _acceptance(stats) > 0.9, stats.spec_decode
    assert llm.engine.scheduler.spec.drafter.caches == {}


def test_generate_command_takes_a_draft_model(llama_dir, capsys):
    from kvserve.entrypoints.cli import main

    spec = json.dumps(_draft(llama_dir))
    assert main(["generate", str(llama_dir), "--speculative-config", spec,
                 "--prompt", "hello world", "--max-tokens", "8"]) == 0
    assert "8 generated" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_server_serves_with_a_draft_model(llama_dir, tmp_path):
    """`kvserve serve --speculative-config` with a draft model: the greedy completion of the
    engine without speculation, and the usage counts the drafts."""
    import openai
    from server_process import ServerProcess

    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17] * 4}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=str(llama_dir), seed=0, max_model_len=512)
    expected = _ids(generate_checked(ref, [prompt], params))[0]
    spec = json.dumps(_draft(llama_dir, k=3))
    proc = ServerProcess("draft", [str(llama_dir), "--served-model-name", "m",
                                   "--speculative-config", spec], tmp_path, max_model_len=512)
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        out = client.completions.create(model="m", prompt=prompt["prompt_token_ids"],
                                        temperature=0.0, max_tokens=24, logprobs=0,
                                        extra_body={"ignore_eos": True})
    finally:
        assert proc.stop() is None, proc.log()[-3000:]
    extra = out.usage.model_extra
    assert extra["num_draft_tokens"] > 0 and extra["num_accepted_tokens"] > 0, extra
    assert out.usage.completion_tokens == len(expected)
    assert out.choices[0].text == ref.engine.tokenizer.decode(expected)
