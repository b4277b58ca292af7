"""kvserve's decoder against transformers' own implementations, on random weights.

Every reference model is built and saved by transformers itself (`save_pretrained`), then loaded
by `kvserve.model_loader.loader.load_model`; logits must agree to 1e-4 in float32. Norm weights and
biases are re-randomised before saving (transformers initialises them to 1 and 0), so a wrong
mapping of either cannot hide.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from kvserve.attention.base import AttentionMetadata, SequenceSlice  # noqa: E402
from kvserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from helpers import pool_over  # noqa: E402
from kvserve.models.config import ModelConfig  # noqa: E402
from kvserve.models.registry import (SUPPORTED_ARCHITECTURES, config_from_dict,  # noqa: E402
                                     config_from_dir)
from kvserve.kernels.cpu import panel_gemm  # noqa: E402
from kvserve.layers.cpu_linear import gemv_available, onednn_available  # noqa: E402
from kvserve.layers.rotary import rope_inv_freq  # noqa: E402
from kvserve.models.decoder import CausalLM  # noqa: E402
from kvserve.worker.model_build import load_model  # noqa: E402
from kvserve.model_loader.make_model import (ARCHS, DEFAULT_MODEL_VERSION,  # noqa: E402
                                             default_model_path, ensure_default_model,
                                             make_model)

transformers.logging.set_verbosity_error()
HAVE_TOKENIZER = importlib.util.find_spec("kvserve.tokenizer.train") is not None

ATOL = 1e-4
VOCAB = 320
LENGTHS = (1, 7, 40)

_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
              initializer_range=0.08, bos_token_id=0, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> (config class, model class, config overrides)
VARIANTS = {
    # untied, llama3 RoPE scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    # q/k/v/o and MLP biases, linear RoPE scaling, tied, multi-query attention
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1,
                        tie_word_embeddings=True,
                        rope_parameters={"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 10000.0})),
    # tied, qkv bias always on
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                              "rope_theta": 1e6})),
    # head_dim 32 != 64 / 4, q/k norms
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # sliding_window set in config (ignored: sequences here are shorter than it)
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(sliding_window=4096, num_key_value_heads=4, tie_word_embeddings=False)),
    # Gemma 3 (text): scaled embeddings, (1 + w) norms around attention and MLP, q/k norms,
    # GELU-tanh, query_pre_attn_scalar != head_dim, final logit soft-capping, and two RoPEs:
    # linear-scaled global layers (1e6), local layers (1e4). Windows are longer than the
    # sequences here (tests/test_window_parity.py covers them).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                    num_hidden_layers=3, sliding_window=4096,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 1e4}})),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, partial RoPE (12 of 16
    # dimensions per head, as Phi-4-mini's 0.75), untied
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.75})),
    # OLMo 2: norms after attention and the MLP only, q/k norms over the whole projection,
    # q/k/v/o biases
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(attention_bias=True, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
    # Granite 3: embedding, residual and attention multipliers, logits divided by
    # logits_scaling, q/k/v/o and MLP biases, tied
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.05, logits_scaling=8.0, attention_bias=True,
                     mlp_bias=True, tie_word_embeddings=True)),
    # Qwen3-MoE: 8 experts, top 2 renormalised, layer 1 of 3 dense (mlp_only_layers), q/k
    # norms, head_dim 16 != 64 / 4
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
                       head_dim=16, tie_word_embeddings=False)),
    # Mixtral: 4 experts of intermediate_size, top 2, untied
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Gemma 2: attention logits soft-capped (50), final logits soft-capped (30), (1 + w) norms
    # around attention and the MLP, GELU-tanh, query_pre_attn_scalar != head_dim, alternating
    # sliding layers (windows longer than the sequences here)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=30.0, sliding_window=4096, num_hidden_layers=3,
                    tie_word_embeddings=True, pad_token_id=0)),
    # SmolLM3: layers 1 and 3 of 4 without RoPE, untied
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(num_hidden_layers=4, no_rope_layer_interval=2, tie_word_embeddings=False,
                     pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}


# -- helpers ----------------------------------------------------------------------------------
def build_hf(variant: str, seed: int = 0, **overrides):
    cfg_name, model_name, extra = VARIANTS[variant]
    config = getattr(transformers, cfg_name)(**{**_SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def causal_attn(scale: float, softcap: float | None = None):
    """One sequence, plain causal attention with GQA: enough to run the model without a cache;
    with `softcap`, Gemma 2's soft-capped scores, spelled out here (transformers' eager
    attention is the reference)."""

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o.transpose(0, 1)
        g = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        s = softcap * torch.tanh(q @ k.transpose(1, 2) * scale / softcap)
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (s.softmax(-1) @ v).transpose(0, 1)

    return attend


def kv_logits(model: CausalLM, config: ModelConfig, ids: torch.Tensor,
              start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[0])
    with torch.inference_mode():
        attend = causal_attn(config.attention_scale, config.attn_logit_softcapping)
        hidden = model(ids, positions, attend)
        return model.compute_logits(hidden)


def hf_logits(model, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[0])[None]
    with torch.no_grad():
        return model(ids[None], position_ids=positions).logits[0].float()


def token_ids(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """variant -> (transformers model, directory it was saved to); built once per module."""
    cache: dict[str, tuple[object, Path]] = {}

    def get(variant: str):
        if variant not in cache:
            model = build_hf(variant)
            path = tmp_path_factory.mktemp(variant)
            model.save_pretrained(path)
            cache[variant] = (model, path)
        return cache[variant]

    return get


# -- float32 parity ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant,gemm", [(v, g) for v in sorted(VARIANTS)
                                          for g in ("onednn", "dense", "panel")]
                         + [("llama_bias", "auto"), ("qwen3", "auto")])
def test_logits_match_transformers(saved, variant, gemm):
    """Every GEMM kernel choice: all oneDNN-packed, all dense (F.linear), all through the panel
    GEMM (where it builds; else dense), and what this CPU's measurement picks (gemm_select.py;
    two variants, as it measures at load)."""
    hf, path = saved(variant)
    model, config = load_model(path, gemm=gemm)
    assert next(model.parameters()).dtype == torch.float32
    if gemm != "auto":
        assert model.packed == (gemm == "onednn"
                                and onednn_available(torch.float32, torch.device("cpu")))
    if gemm == "panel" and panel_gemm.available(torch.float32, torch.device("cpu")):
        assert set(model.gemm_plan.kernels["qkv"][1:-1] + model.gemm_plan.kernels["head"][1:-1]) \
            == {"panel"}  # where it is offered: above the GEMV's bucket, up to 512 rows
    assert model.gemm_plan is not None
    for i, n in enumerate(LENGTHS):
        ids = token_ids(n, seed=100 + i)
        ref = hf_logits(hf, ids)
        out = kv_logits(model, config, ids)
        assert out.dtype == torch.float32 and out.shape == (n, VOCAB)
        assert ref.abs().max() > 0.5  # the comparison is not between near-zero logits
        diff = (out - ref).abs().max().item()
        assert diff < ATOL, f"{variant} length {n}: max abs diff {diff}"
    # Late positions exercise the far end of the RoPE cache.
    ids = token_ids(7, seed=99)
    start = config.max_position_embeddings - 7
    diff = (kv_logits(model, config, ids, start) - hf_logits(hf, ids, start)).abs().max().item()
    assert diff < ATOL, f"{variant} at positions {start}+: max abs diff {diff}"
    # The (scaled) inverse frequencies are bit-identical to transformers' (with partial RoPE,
    # followed by zeros: the dimensions that pass unrotated).
    rotary = hf.model.rotary_emb
    if config.sliding_rope_theta is None:
        ours, n = rope_inv_freq(config), rotary.inv_freq.shape[0]
        assert torch.equal(ours[:n], rotary.inv_freq) and not ours[n:].any()
        assert (n < config.head_dim // 2) == (variant == "phi3")
    else:  # Gemma 3: one RoPE per layer type
        assert torch.equal(rope_inv_freq(config), rotary.full_attention_inv_freq)
        assert torch.equal(rope_inv_freq(config, config.sliding_rope_theta),
                           rotary.sliding_attention_inv_freq)


@pytest.mark.skipif(not onednn_available(torch.float32, torch.device("cpu")),
                    reason="oneDNN cannot pack float32 weights here")
@pytest.mark.parametrize("variant", ["llama_bias", "qwen3", "gemma3", "olmo2"])
def test_mixed_gemm_plan_matches_transformers(saved, variant):
    """A plan that switches kernel between row buckets, differently per projection, gives
    transformers' logits at a row count in every bucket (so each bucket's bound ops are the
    right ones, biases and residual adds included; Gemma 3: the GELU-tanh gate and the output
    norms before the residual adds, on every kernel): dense, oneDNN and (where it builds) the
    panel GEMM."""
    from kvserve.layers.gemm_select import BUCKETS, GemmPlan

    hf, path = saved(variant)
    n = len(BUCKETS)
    kinds = ("dense", "onednn") + (
        ("panel",) if panel_gemm.available(torch.float32, torch.device("cpu")) else ())
    k = len(kinds)
    plan = GemmPlan({"qkv": [kinds[b % k] for b in range(n)],
                     "o": [kinds[(b + 1) % k] for b in range(n)],
                     "mlp": [kinds[(b + 2) % k] for b in range(n)],
                     "down": [kinds[b // 2 % k] for b in range(n)],
                     "head": [kinds[(b + 1) % k] for b in range(n)]}, "test")
    model, config = load_model(path, gemm_plan=plan)
    assert model.packed and model.gemm_plan is plan
    for i, (limit, probe) in enumerate(BUCKETS):
        t = min(probe + 3, int(limit)) if limit != float("inf") else 600
        diff = _one_forward_diff(model, hf, config, token_ids(t, seed=200 + i))
        assert diff < ATOL, f"{variant}, {t} rows (bucket {i}): relative diff {diff}"


def _one_forward_diff(model, hf, config, ids: torch.Tensor) -> float:
    """Max |logits - transformers'| for ids [T] as one forward of T rows (positions wrap at
    max_position_embeddings), relative to the largest |logit| where that is above 1. Why
    relative: float32 rounding grows with the logits' scale and the row count, and differs
    between instruction sets. Gemma 3 here (|logits| up to 5.9, scaled embeddings, (1 + w)
    norms) at 650 rows: transformers' own float32 logits are 8.4e-5 from its float64 ones;
    kvserve's were 9.7e-5 from them with AVX-512 and 1.03e-4 under the AVX2 caps
    (cpu_features.isa_cap_env), past an absolute ATOL (llama_bias: 1.7e-6 either way)."""
    pos = torch.arange(ids.shape[0]) % config.max_position_embeddings
    with torch.inference_mode():
        attend = causal_attn(config.attention_scale, config.attn_logit_softcapping)
        out = model.compute_logits(model(ids, pos, attend))
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None]).logits[0].float()
    return (out - ref).abs().max().item() / max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("variant", ["llama_bias", "gemma3", "olmo2"])
@pytest.mark.parametrize("gemm", ["onednn", "dense"])
def test_long_prefill_mlp_in_chunks_matches_transformers(saved, variant, gemm):
    """A long prefill's MLP runs a chunk of rows at a time (cpu_methods.mlp_chunk_rows; made 200
    rows here, the last chunk partial): transformers' logits, with the residual added in
    place (dense) and through oneDNN's padded rows, whose result is copied back; Gemma 3's
    output norm before the add."""
    from kvserve.layers.cpu_methods import mlp_chunk_rows

    # ~16 MiB of gate/up activations per chunk, >= 256 rows, a multiple of 64
    assert mlp_chunk_rows(1408, 4) == 1472 and mlp_chunk_rows(11008, 4) == 256
    hf, path = saved(variant)
    model, config = load_model(path, gemm=gemm)
    for layer in model.layers:
        assert layer.method.mlp_chunk_rows is not None
        layer.method.mlp_chunk_rows = 200
    diff = _one_forward_diff(model, hf, config, token_ids(650, seed=400))
    assert diff < ATOL, f"{variant}, {gemm}, 650 rows in MLP chunks of 200: relative diff {diff}"


@pytest.mark.skipif(not gemv_available(torch.float32, torch.device("cpu")),
                    reason="the C++ GEMV kernel could not be built")
@pytest.mark.parametrize("variant", ["llama_bias", "qwen3", "gemma3", "qwen2", "phi3", "olmo2"])
def test_gemv_plan_matches_transformers(saved, variant):
    """The C++ GEMV in the first row bucket (1-4 rows: biases, the SiLU / GELU-tanh gate, the
    fused residual adds, Gemma's output norms, tied and untied LM heads, Phi-3's partial RoPE
    in the fused RoPE, OLMo 2's GEMMs on the un-normed residual) and dense above it:
    transformers' logits at every row count of that bucket and one above."""
    hf, path = saved(variant)
    model, config = load_model(path, gemm="gemv")
    assert model.gemm_plan.kernels["qkv"][0] == "gemv"
    assert model.gemm_plan.kernels["head"][0] == "gemv"
    for t in (1, 2, 3, 4, 5):
        ids = token_ids(t, seed=300 + t)
        diff = (kv_logits(model, config, ids) - hf_logits(hf, ids)).abs().max().item()
        assert diff < ATOL, f"{variant}, {t} rows: max abs diff {diff}"


def test_config_fields_from_transformers(saved):
    _, path = saved("qwen3")
    c = config_from_dir(path)
    assert (c.architecture, c.head_dim, c.num_key_value_heads, c.qk_norm) == \
        ("Qwen3ForCausalLM", 32, 2, True)
    assert not c.tie_word_embeddings and c.rope_scaling is None and c.torch_dtype == "float32"
    c = config_from_dir(saved("llama")[1])
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["original_max_position_embeddings"] == 64
    c = config_from_dir(saved("qwen2")[1])
    assert c.attention_bias and c.tie_word_embeddings and c.rope_theta == 1e6
    c = config_from_dir(saved("mistral")[1])
    assert not c.attention_bias
    c = config_from_dir(saved("phi3")[1])
    assert (c.architecture, c.head_dim, c.rotary_dim, c.rms_norm_eps) == \
        ("Phi3ForCausalLM", 16, 12, 1e-5)
    assert c.pre_norms and not c.output_norms and not c.attention_bias and not c.qk_norm
    c = config_from_dir(saved("olmo2")[1])
    assert (c.architecture, c.rotary_dim, c.rope_scaling["rope_type"]) == \
        ("Olmo2ForCausalLM", None, "linear")
    assert not c.pre_norms and c.output_norms and c.qk_norm and not c.qk_norm_per_head
    assert c.attention_bias and c.o_proj_bias


def test_phi3_options_the_engine_does_not_run_are_refused(saved):
    """Phi-3's longrope (the 128k models, Phi-3.5, Phi-4-mini; "su" in older configs) and a
    partial RoPE of an odd number of dimensions: a ValueError naming them."""
    d = json.loads((saved("phi3")[1] / "config.json").read_text())
    for kind in ("longrope", "su"):
        rope = {"rope_type": kind, "short_factor": [1.0] * 6, "long_factor": [1.0] * 6}
        with pytest.raises(ValueError, match="longrope"):
            config_from_dict({**d, "rope_parameters": rope})
    with pytest.raises(ValueError, match="must be even"):
        config_from_dict({**d, "rope_parameters": {"rope_type": "default",
                                                    "partial_rotary_factor": 0.3125}})


def test_legacy_v4_config_layout():
    """transformers 4 wrote rope_theta/rope_scaling/torch_dtype at the top level."""
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 100,
         "rope_theta": 500000.0, "torch_dtype": "bfloat16", "max_position_embeddings": 1024,
         "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}
    c = config_from_dict(d)
    assert c.rope_theta == 500000.0 and c.torch_dtype == "bfloat16"
    assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    with pytest.raises(ValueError, match="yarn"):
        config_from_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# -- paged attention --------------------------------------------------------------------------
def test_paged_backend_prefill_chunk_and_decode(saved):
    """Two steps through TorchAttentionBackend with scattered block tables: step 1 prefills A
    (19 tokens) and C (9 tokens); step 2 prefills B from scratch, continues C with a 6-token
    chunk on its cached context, and decodes A's 20th token from its cache."""
    hf, path = saved("qwen3")
    model, config = load_model(path)
    bs, num_blocks = 4, 24
    kv_caches = [(torch.zeros(num_blocks, bs, config.num_key_value_heads, config.head_dim),
                  torch.zeros(num_blocks, bs, config.num_key_value_heads, config.head_dim))
                 for _ in range(config.num_hidden_layers)]
    backend = TorchAttentionBackend(pool_over(kv_caches), config.attention_scale)
    seqs = {"A": token_ids(20, 1), "B": token_ids(11, 2), "C": token_ids(15, 3)}
    tables = {"A": [5, 2, 17, 0, 9], "B": [1, 23, 8], "C": [12, 4, 6, 20]}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}

    def step(parts: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
        """parts: (sequence, first position, last position + 1), prefills first."""
        ids, pos, slots, prefills, decodes = [], [], [], [], []
        for name, lo, hi in parts:
            sl = SequenceSlice(len(ids), hi - lo, hi, tables[name])
            (prefills if hi - lo > 1 else decodes).append(sl)
            ids += seqs[name][lo:hi].tolist()
            pos += range(lo, hi)
            slots += [tables[name][p // bs] * bs + p % bs for p in range(lo, hi)]
        meta = AttentionMetadata(torch.tensor(slots), prefills, decodes,
                                 sum(s.query_len for s in prefills))
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), backend.bind(meta))
            logits = model.compute_logits(hidden)
        out, row = {}, 0
        for name, lo, hi in parts:
            out[name] = logits[row: row + hi - lo]
            row += hi - lo
        return out

    first = step([("A", 0, 19), ("C", 0, 9)])
    torch.testing.assert_close(first["A"], refs["A"][:19], atol=ATOL, rtol=0)
    torch.testing.assert_close(first["C"], refs["C"][:9], atol=ATOL, rtol=0)
    second = step([("B", 0, 11), ("C", 9, 15), ("A", 19, 20)])
    torch.testing.assert_close(second["B"], refs["B"], atol=ATOL, rtol=0)
    torch.testing.assert_close(second["C"], refs["C"][9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second["A"], refs["A"][19:], atol=ATOL, rtol=0)


# -- dtypes and checkpoint layouts ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(saved, dtype):
    hf, path = saved("llama")
    model, config = load_model(path, dtype=str(dtype).removeprefix("torch."))
    assert all(p.dtype == dtype for p in model.parameters())
    ids = token_ids(40, 7)
    ref = hf_logits(hf, ids)
    out = kv_logits(model, config, ids)
    assert out.dtype == torch.float32
    # Loose: half-precision rounding of weights and activations.
    assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_gemma_embedding_scale_is_one_buffer_in_the_weights_dtype(saved):
    """Gemma's sqrt(hidden_size) is built once, as a buffer that moves with the model, and
    rounded to the weights' dtype as transformers rounds its own (bfloat16: 45.25, not 45.2548
    for hidden 2048; here the tiny config's)."""
    hf, path = saved("gemma3")
    model, _ = load_model(path, dtype="bfloat16")
    assert dict(model.named_buffers())["embed_scale"] is model.embed_scale
    assert model.embed_scale.dtype == torch.bfloat16
    assert model.embed_scale.item() == hf.model.embed_tokens.embed_scale.to(torch.bfloat16).item()


def test_auto_dtype_follows_config(tmp_path):
    """dtype="auto" takes a bf16 checkpoint's dtype where this CPU has bf16 instructions
    (AVX512_BF16 or AMX: bf16 logits near transformers' bf16 ones); without them (an AVX2-only
    EPYC, or KVSERVE_CPU_ISA=avx2) it loads in float32 and matches transformers' float32
    logits. An explicit float32 is float32 on every CPU. (The CPU without bf16 is also run on
    this one, under the cap: test_auto_dtype_under_the_avx2_cap.)"""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    hf = build_hf("qwen2").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model, config = load_model(tmp_path)
    assert config.torch_dtype == "bfloat16"
    ids = token_ids(7, 8)
    out = kv_logits(model, config, ids)
    if cpu_info().has_bf16:
        assert next(model.parameters()).dtype == torch.bfloat16, cpu_info().summary()
        ref = hf_logits(hf, ids)
        assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    else:
        assert next(model.parameters()).dtype == torch.float32, cpu_info().summary()
        # (transformers' own float32 load: hf.float() would keep its RoPE's bf16-rounded buffer)
        hf32 = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert (out - hf_logits(hf32.eval(), ids)).abs().max().item() < ATOL
    model32, _ = load_model(tmp_path, dtype="float32")
    assert next(model32.parameters()).dtype == torch.float32


CAPPED_DTYPE = """
import json, logging, sys
import torch
import torch.nn.functional as F
from kvserve.kernels.cpu.cpu_features import cpu_info
from kvserve.worker.model_build import load_model
warnings = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("kvserve").addHandler(handler)
model, config = load_model(sys.argv[1])
ids = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(8))
def attend(layer_idx, q, k, v):  # as causal_attn
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=config.attention_scale, enable_gqa=True).transpose(0, 1)
with torch.inference_mode():
    torch.save(model.compute_logits(model(ids, torch.arange(7), attend)), sys.argv[2])
auto_warnings = list(warnings)
model16, _ = load_model(sys.argv[1], dtype="bfloat16", pack_weights=False)
print(json.dumps({"has_bf16": cpu_info().has_bf16, "cap": cpu_info().isa_cap,
                  "auto": str(next(model.parameters()).dtype),
                  "bf16": str(next(model16.parameters()).dtype),
                  "auto_warnings": auto_warnings, "warnings": warnings[len(auto_warnings):]}))
"""


def _x86_64_v3() -> bool:
    from kvserve.kernels.cpu.cpu_features import ISA_CAPS, _host_cpu

    return all(f in _host_cpu().flags for f in ISA_CAPS["avx2"][1])


@pytest.mark.skipif(not _x86_64_v3(), reason="KVSERVE_CPU_ISA=avx2 needs an x86-64-v3 CPU")
def test_auto_dtype_under_the_avx2_cap(tmp_path):
    """The CPU without bf16 instructions for real, on any x86-64-v3 CPU: a fresh process under
    the AVX2 cap (KVSERVE_CPU_ISA and the libraries' caps, cpu_features.isa_cap_env) sees no
    bf16, loads the bf16 checkpoint in float32 for "auto" (transformers' float32 logits, no
    warning) and honours an explicit bfloat16 with one warning that states the measured cost."""
    import os
    import subprocess
    import sys

    from kvserve.kernels.cpu.cpu_features import isa_cap_env

    build_hf("qwen2").to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, **isa_cap_env("avx2"), PYTHONPATH=str(tests.parent))
    proc = subprocess.run([sys.executable, "-c", CAPPED_DTYPE, str(tmp_path / "ckpt"),
                           str(tmp_path / "logits.pt")], cwd=tests.parent,
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["has_bf16"], out["cap"]) == (False, "avx2")
    assert (out["auto"], out["bf16"]) == ("torch.float32", "torch.bfloat16")
    cost = r"dtype=bfloat16 on a CPU without bf16 .* takes [0-9.]+x as long as in float32 here"
    assert not [w for w in out["auto_warnings"] if "bf16" in w], out["auto_warnings"]
    assert len([w for w in out["warnings"] if re.search(cost, w)]) == 1, out["warnings"]
    hf32 = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    logits = torch.load(tmp_path / "logits.pt")
    assert (logits - hf_logits(hf32.eval(), token_ids(7, 8))).abs().max().item() < ATOL


def test_auto_dtype_on_a_cpu_without_bf16(tmp_path, monkeypatch, caplog):
    """dtype="auto" keeps a bf16 checkpoint in bf16 only where the CPU has bf16 instructions;
    without them it runs in float32 (and matches transformers' float32 logits), and an
    explicit bfloat16 there is honoured with a warning that states the measured cost."""
    import logging

    from kvserve.layers import selection
    from kvserve.kernels.cpu.cpu_features import CpuInfo

    build_hf("qwen2").to(torch.bfloat16).save_pretrained(tmp_path)
    hf32 = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    monkeypatch.setattr(selection, "cpu_info", lambda: CpuInfo("test CPU", frozenset({"avx2"}), 2))
    logger = logging.getLogger("kvserve")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kvserve"):
            model, config = load_model(tmp_path)
            assert next(model.parameters()).dtype == torch.float32
            ids = token_ids(7, 8)
            diff = (kv_logits(model, config, ids) - hf_logits(hf32, ids)).abs().max().item()
            assert diff < ATOL
            model16, _ = load_model(tmp_path, dtype="bfloat16")
            assert next(model16.parameters()).dtype == torch.bfloat16
    finally:
        logger.removeHandler(caplog.handler)
    # (a set: the record may reach caplog twice, through its handler and the root logger)
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert len(warnings) == 1, warnings
    assert re.search(r"takes [0-9.]+x as long as in float32 here", warnings.pop())
    monkeypatch.setattr(selection, "cpu_info",
                        lambda: CpuInfo("test CPU", frozenset({"avx512_bf16"}), 2))
    assert next(load_model(tmp_path)[0].parameters()).dtype == torch.bfloat16


def test_sharded_checkpoint(tmp_path):
    hf = build_hf("mistral", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, config = load_model(tmp_path)
    ids = token_ids(7, 9)
    assert (kv_logits(model, config, ids) - hf_logits(hf, ids)).abs().max().item() < ATOL


# -- make_model -------------------------------------------------------------------------------
# DeepSeek's checkpoints (MLA attention) are checked in tests/test_mla.py.
@pytest.mark.parametrize("arch", [a for a in ARCHS if not a.startswith("deepseek")])
def test_make_model_loads_in_both(tmp_path, arch):
    path = make_model(tmp_path / arch, arch, "tiny", seed=1, with_tokenizer=HAVE_TOKENIZER)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    if HAVE_TOKENIZER:
        assert "tokenizer.json" in names
    model, config = load_model(path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == config.architecture
    assert config.tie_word_embeddings == (arch in ("qwen2", "qwen3", "gemma3", "smollm3", "gemma2"))
    if arch == "qwen3":
        assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    gen_cfg = json.loads((path / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == config.eos_token_id == 2
    assert gen_cfg["bos_token_id"] == 0
    for n in (1, 40):
        ids = token_ids(n, 11, config.vocab_size)
        assert (kv_logits(model, config, ids) - hf_logits(hf.eval(), ids)).abs().max() < ATOL


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_cli_make_model_writes_transformers_config(tmp_path, arch):
    """`kvserve make-model --arch phi3|olmo2` (the command line's choices are the registry's):
    transformers' own config class wrote the config.json, and the checkpoint loads in kvserve
    with transformers' logits."""
    from kvserve.entrypoints.cli import main

    path = tmp_path / arch
    assert main(["make-model", str(path), "--arch", arch, "--seed", "2"]) == 0
    cfg = json.loads((path / "config.json").read_text())
    name = {"phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}[arch]
    assert cfg["architectures"] == [name] and cfg["model_type"] == arch
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    assert cfg == {**hf_cfg.to_diff_dict(), "architectures": [name]}
    model, config = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = token_ids(17, 13, config.vocab_size)
    assert (kv_logits(model, config, ids) - hf_logits(hf, ids)).abs().max() < ATOL


def test_make_model_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(make_model(tmp_path / "a", "llama", "tiny", seed=5, with_tokenizer=False)
                  / "model.safetensors")
    b = load_file(make_model(tmp_path / "b", "llama", "tiny", seed=5, with_tokenizer=False)
                  / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not HAVE_TOKENIZER, reason="kvserve.tokenizer.train not available yet")
def test_ensure_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == default_model_path() == tmp_path / f"default-qwen2-tiny-v{DEFAULT_MODEL_VERSION}"
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary leftovers
    load_model(path)


# -- broken checkpoints -----------------------------------------------------------------------
@pytest.fixture
def tiny_ckpt(tmp_path):
    return make_model(tmp_path / "m", "llama", "tiny", with_tokenizer=False)


def test_unsupported_architecture(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_model(tiny_ckpt)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_missing_config(tiny_ckpt, tmp_path):
    (tiny_ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_model(tiny_ckpt)
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_invalid_config(tiny_ckpt):
    (tiny_ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse"):
        load_model(tiny_ckpt)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 128}
    (tiny_ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        load_model(tiny_ckpt)


def test_missing_tensor(tiny_ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tiny_ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tiny_ckpt)


def test_wrong_shape(tiny_ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, tiny_ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape"):
        load_model(tiny_ckpt)


def test_truncated_safetensors(tiny_ckpt):
    f = tiny_ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tiny_ckpt)
    f.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tiny_ckpt)


def test_no_weights(tiny_ckpt):
    (tiny_ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors"):
        load_model(tiny_ckpt)


def test_tied_checkpoint_with_only_lm_head(tmp_path):
    """Some exports of tied models store the shared matrix as lm_head.weight only."""
    from safetensors.torch import load_file, save_file

    hf = build_hf("qwen2", seed=4)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, config = load_model(tmp_path)
    ids = token_ids(7, 12)
    assert (kv_logits(model, config, ids) - hf_logits(hf, ids)).abs().max().item() < ATOL
