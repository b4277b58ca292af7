"""Deterministic inference (issue 64): a request gets the same tokens and logprobs, bit for bit,
whatever its batch, its prefill chunks, the prefix cache or speculative decoding did.

What it costs and how it works: docs/deterministic.md. Here: the engine's results against
transformers on the same weights (the per-row prefill must still be attention: full and
sliding-window layers, chunks, a cached head), the issue's own check on the quantized default
model and a Q4_K_M-style mix, on this CPU's kernels and on the AVX2 ones
(benchmarks/check_invariance.py, in a process of its own: the kernels' instruction set is
chosen once a process), and the refusals of what it cannot cover. The on/off guards on the
quantized models: tests/test_differential_quantized.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (first_token_logits, generate_checked, hf_greedy, random_prompts,
                     save_random_checkpoint)

from kvserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512


def _hf_last_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory) -> Path:
    """Mistral with a sliding window of 8 tokens: every prefill row's window start differs."""
    import transformers

    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=512,
                                     tie_word_embeddings=False, rope_theta=1e4, sliding_window=8)
    return save_random_checkpoint(cfg, tmp_path_factory.mktemp("mistral-w8"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "windowed"])
def test_deterministic_engine_matches_transformers(arch, hf_checkpoints, windowed_dir):
    """Every prefill row through the paged kernel is still the model's attention: greedy
    tokens equal transformers' generate, and the first token's logits its forward's within
    1e-4, with chunks of 7 tokens beside other requests and one prompt's head cached."""
    path = windowed_dir if arch == "windowed" else hf_checkpoints[arch]
    prompts = random_prompts([3, 17, 40, 129], VOCAB, seed=64)
    prompts.append(prompts[2][:24] + prompts[1][:9])  # its head cached by the third's
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=4,
              max_num_batched_tokens=32, long_prefill_token_threshold=7, deterministic=True)
    captured = first_token_logits(llm, [prompts[:3], prompts[3:]])
    for p, want in zip(prompts, _hf_last_logits(path, prompts)):
        got = captured[tuple(p)]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 10)


def _check_invariance(isa: str | None, model: Path | None, tmp_path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if isa is not None:
        env["KVSERVE_CPU_ISA"] = isa
    args = [sys.executable, str(ROOT / "benchmarks" / "check_invariance.py"), "--deterministic",
            "--variations", "2", "--max-tokens", "40"]
    if model is not None:
        args += ["--model", str(model)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def q4_k_m_like(tmp_path_factory) -> Path:
    from gguf_files import requantize_mixed, smollm2_path
    from test_quant_kquants import _q4_k_m_like

    return requantize_mixed(smollm2_path(), tmp_path_factory.mktemp("q4km") / "q4_k_m.gguf",
                            _q4_k_m_like)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("isa,model", [(None, "smollm2-q4_1"), ("avx2", "smollm2-q4_1"),
                                       ("avx512", "smollm2-q4_1"), (None, "q4_k_m-like"),
                                       ("avx2", "q4_k_m-like")])
def test_the_cached_repeat_and_the_batch_answer_the_same(isa, model, q4_k_m_like, tmp_path):
    """Issue 64's sequence (a code chat, a chat on Python's LICENSE.txt, that chat again from
    the prefix cache) and two held-out variations (other prompts, chunks of 16-512 tokens,
    1-8 neighbours): the same tokens and logprobs alone, in a batch and cached. `isa` avx2:
    the AVX2 kernels (KVSERVE_CPU_ISA), whose measured plan runs MKL above a few rows where
    the default mode would; avx512: an Ice Lake's (VNNI, no bf16), where this CPU has more."""
    from kvserve.kernels.cpu import qgemv
    from kvserve.kernels.cpu.cpu_features import ISA_CAPS, _host_cpu

    if qgemv.load() is None:
        pytest.skip("no C++ compiler: no quantized kernels")
    if isa is not None and not set(ISA_CAPS[isa][1]) <= _host_cpu().flags:
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    out = _check_invariance(isa, None if model == "smollm2-q4_1" else q4_k_m_like, tmp_path)
    assert "every comparison the same" in out and out.count("same") >= 5, out


def test_check_invariance_reports_a_difference():
    """The comparison itself: a token or a logprob one ulp off is reported."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from check_invariance import differs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    a = ([5, 6], [-0.5, -1.25])
    assert differs(a, a) is None
    assert differs(a, ([5, 7], [-0.5, -1.25])).startswith("token 1")
    off = float(torch.nextafter(torch.tensor(-1.25), torch.tensor(0.0)))
    assert differs(a, ([5, 6], [-0.5, off])).startswith("logprob 1")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kv_cache_dtype="int4"), "int4"),
    (dict(attention_backend="triton"), "torch attention backend"),
])
def test_what_deterministic_cannot_cover_is_refused(kwargs, needle, tiny_model_dir):
    with pytest.raises(ValueError, match=needle):
        LLM(model=str(tiny_model_dir), dtype="float32", deterministic=True, **kwargs)


def test_gemma2_soft_capping_is_refused(hf_checkpoints):
    with pytest.raises(ValueError, match="soft-capping"):
        LLM(model=str(hf_checkpoints["gemma2"]), dtype="float32", deterministic=True)


def test_the_flag_and_its_sglang_name(tiny_model_dir):
    from kvserve.entrypoints.cli import build_parser

    for flag in ("--deterministic", "--enable-deterministic-inference"):
        args = build_parser().parse_args(["generate", str(tiny_model_dir), flag])
        assert args.deterministic is True
