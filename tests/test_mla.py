"""DeepSeek-V2/V3 (MLA + MoE) against transformers on the same random weights.

The checkpoints are written by transformers' own `save_pretrained` (the independent reference):
V2 without q_lora and with MoE, V2 with q_lora and only dense layers, V2 with group-limited
gating and YaRN (mscale), V3 (sigmoid noaux_tc gating, e_score_correction_bias, YaRN). The engine
must produce transformers' greedy tokens across block sizes, chunked prefill, preemption, prefix
hits and a tier round trip, and first-token logits within 1e-4; the latent pool's bytes per token
must be the planner's; absorbed and decompressing decode must equal a plain per-head reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers import first_token_logits, generate_checked, hf_greedy, random_prompts

from kvserve import LLM, SamplingParams
from kvserve.kv.spec import KVStorage, decoder_kv_spec
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.base import AttentionMetadata, SequenceSlice
from kvserve.attention.mla import MLAProjections, TorchMLABackend
from kvserve.layers.selection import warm_up_gemms

VOCAB = 512
NEW = 8
LENGTHS = [1, 5, 17, 40, 64, 129, 200]
YARN = {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 128, "rope_theta": 10000.0}
VARIANTS = {
    "v2_moe": dict(q_lora_rank=None),
    "v2_qlora_dense": dict(q_lora_rank=24, first_k_dense_replace=3),
    "v2_group_yarn": dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                          topk_group=2, routed_scaling_factor=1.5, rope_parameters=YARN),
    "v3": dict(v3=True, q_lora_rank=24, n_group=4, topk_group=2,
               rope_parameters={**YARN, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
}


def make_deepseek_checkpoint(out, v3: bool = False, seed: int = 0, **overrides):
    import transformers

    from kvserve.tokenizer.train import train_tokenizer

    torch.manual_seed(seed)
    cls = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=1024, bos_token_id=0,
                  eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    with torch.no_grad():  # a wide spread: well separated argmaxes (see conftest)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.12)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.05)
    model.save_pretrained(out)
    train_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_deepseek_checkpoint(root / name, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for i, (name, path) in enumerate(checkpoints.items()):
        prompts = random_prompts(LENGTHS, VOCAB, seed=10 + i)
        refs[name] = (prompts, hf_greedy(path, prompts, NEW))
    return refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
LATENT_BYTES = 3 * (32 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x fp32
SCENARIOS = {
    "block16": dict(block_size=16),
    "block1": dict(block_size=1),
    "block7": dict(block_size=7),
    "chunked": dict(block_size=16, max_num_batched_tokens=48),
    # 22 blocks of 8 for six 30-token prompts that grow to 38 (5 blocks each): preemptions.
    "preempt": dict(block_size=8, kv_cache_memory_bytes=22 * 8 * LATENT_BYTES),
}
PREEMPT_LENGTHS = [30] * 6
# Every scenario for the two V2 shapes the issue names; the main ones for the others.
CASES = [(v, s) for v in ("v2_moe", "v2_qlora_dense") for s in SCENARIOS] + \
    [(v, s) for v in ("v2_group_yarn", "v3") for s in ("block16", "chunked")]


@pytest.mark.parametrize(("variant", "scenario"), CASES)
def test_greedy_matches_transformers(variant, scenario, checkpoints, references):
    prompts, expected = references[variant]
    if scenario == "preempt":
        prompts = random_prompts(PREEMPT_LENGTHS, VOCAB, seed=99)
        expected = hf_greedy(checkpoints[variant], prompts, NEW)
    llm = LLM(model=str(checkpoints[variant]), dtype="float32", max_model_len=512,
              **SCENARIOS[scenario])
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool forced no preemption"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_first_token_logits_match(variant, checkpoints, references):
    import transformers

    prompts, _ = references[variant]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[variant],
                                                                  dtype=torch.float32)
    with torch.no_grad():
        ref = [ref_model(torch.tensor([p])).logits[0, -1] for p in prompts]
    llm = LLM(model=str(checkpoints[variant]), dtype="float32", max_model_len=512, block_size=16)
    captured = first_token_logits(llm, [prompts])
    for p, want in zip(prompts, ref):
        got = captured[tuple(p)]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_decode_logits_match_over_many_steps(checkpoints):
    """Logits of every decode step (absorbed decode over the latent cache) against
    transformers' forward over the whole sequence so far."""
    import transformers

    path = checkpoints["v3"]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=4)
    prompt = random_prompts([23], VOCAB, seed=3)[0]
    runner = llm.engine.runner
    steps: list[torch.Tensor] = []
    original = runner.forward

    def spy(seqs):
        out = original(seqs)
        steps.append(out.logits[0].clone())
        return out

    runner.forward = spy
    out = generate_checked(llm, [{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = ref_model(torch.tensor([seq])).logits[0]
    for i, got in enumerate(steps):
        want = ref[len(prompt) - 1 + i]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (i, (got - want).abs().max())


def test_prefix_hits_match_transformers(checkpoints):
    """A shared 96-token prefix computed once, then hit by the other prompts (also a prompt
    ending inside a cached block: copy-on-write of the partial block)."""
    path = checkpoints["v2_moe"]
    prefix = random_prompts([96], VOCAB, seed=5)[0]
    tails = random_prompts([7, 20, 1], VOCAB, seed=6)
    prompts = [prefix + t for t in tails] + [prefix[:90]]
    expected = hf_greedy(path, prompts, NEW)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16)
    copies: list[tuple[list[int], list[int]]] = []
    copy_blocks = llm.engine.backend.copy_blocks
    llm.engine.backend.copy_blocks = lambda s, d: (copies.append((s, d)), copy_blocks(s, d))
    first = generate_checked(llm, [{"prompt_token_ids": prompts[0]}], GREEDY)
    rest = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
    outs = first + rest
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 80 for o in rest), [o.num_cached_tokens for o in rest]
    assert rest[-1].num_cached_tokens == 89 and copies, "no copy-on-write of the partial block"


def test_tier_round_trip_matches_transformers(checkpoints):
    """Latent blocks saved to the host tier, the device prefix cache wiped, then loaded back:
    the same tokens as transformers, served from the tier."""
    path = checkpoints["v3"]
    prompts = random_prompts([70, 100], VOCAB, seed=8)
    expected = hf_greedy(path, prompts, NEW)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16,
              kv_tier_config={"chunk_size": 32, "local_cpu": True, "max_local_cpu_size": 0.01,
                              "write_policy": "write_through"})
    ps = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in generate_checked(llm, ps, GREEDY)] == expected
    llm.engine.tiers.flush()
    llm.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in generate_checked(llm, ps, GREEDY)] == expected
    assert llm.engine.stats().hit_tokens["host"] >= 64 + 96
    tier = llm.engine.tier_stats()
    assert tier["bytes_loaded"].get("host", 0) > 0 and not tier["errors"], tier
    llm.engine.shutdown()


# -- bytes per token: pool == planner == the textbook formula ---------------------------------
def test_pool_bytes_per_token_equal_the_planner(checkpoints):
    from kvserve.planner.memory import kv_bytes_per_token
    from kvserve.planner.model import ModelSpec

    path = checkpoints["v2_moe"]
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16,
              kv_cache_memory_bytes=64 * 16 * LATENT_BYTES)
    pool = llm.engine.tensors
    allocated = sum(t.numel() * t.element_size() for layer in pool.layers for t in layer)
    per_token = allocated // (pool.num_blocks * pool.block_size)
    assert pool.num_blocks == 64
    assert per_token == LATENT_BYTES == llm.engine.kv_spec.bytes_per_token
    assert kv_bytes_per_token(ModelSpec.load(str(path)), "fp32") == per_token
    # and bf16 halves it in both
    assert kv_bytes_per_token(ModelSpec.load(str(path)), "bf16") == per_token // 2


def test_capacity_line_shows_the_mla_saving(checkpoints, caplog):
    from kvserve.kv.spec import MLALatentSpec, mla_saving_line

    line = mla_saving_line(MLALatentSpec(512, 64), num_heads=128, qk_head_dim=192, v_head_dim=128)
    assert "576" in line and "40,960" in line and "71.1x" in line, line
    with caplog.at_level("INFO", logger="kvserve"):
        LLM(model=str(checkpoints["v2_moe"]), dtype="float32", max_model_len=512)
    # 4 heads x (24 + 16) = 160 decompressed values vs 40 latent ones per token and layer
    assert any("MLA latent cache" in r.message and "4.0x" in r.message for r in caplog.records)



@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "float16"])
def test_kv_cache_dtype_other_than_the_models_is_refused(checkpoints, kv_cache_dtype):
    """The latent cache is never quantized (nor stored in another float type): a clear
    ValueError before any memory is sized; the codec refuses a quantized latent on its own."""
    from kvserve.kv.quant import make_codec
    from kvserve.kv.spec import KVStorage, MLALatentSpec

    with pytest.raises(ValueError, match="MLA models .* keep their latent cache"):
        LLM(model=str(checkpoints["v2_moe"]), dtype="float32", max_model_len=512,
            kv_cache_dtype=kv_cache_dtype)
    with pytest.raises(ValueError, match="quantized KV .* not MLALatentSpec"):
        make_codec(MLALatentSpec(32, 8, KVStorage("int8")), 16, None, None)

# -- the backend alone: absorbed and decompressing decode against a per-head reference -------
def reference_mla(q_nope, q_rope, ctx, w_uk, w_uv, scale, rank):
    """Per head, per sequence: decompressed keys/values, softmax over the context (fp64)."""
    out = []
    for b in range(q_nope.shape[0]):
        c = ctx[b].double()
        heads = []
        for h in range(q_nope.shape[1]):
            k = torch.cat((c[:, :rank] @ w_uk[h].double().t(), c[:, rank:]), dim=-1)
            v = c[:, :rank] @ w_uv[h].double().t()
            q = torch.cat((q_nope[b, h], q_rope[b, h])).double()
            heads.append(torch.softmax(k @ q * scale, dim=0) @ v)
        out.append(torch.stack(heads))
    return torch.stack(out)


def decode_setup(lens, block_size=4, heads=4, rank=32, rope=8, nope=16, v_dim=16, seed=0):
    """A pool whose sequences' latents are laid out in scattered blocks, the decode metadata for
    one new token each (already written), queries and projections."""
    g = torch.Generator().manual_seed(seed)
    spec = decoder_kv_spec(1, 1, 1, KVStorage("fp32"), block_size, kv_lora_rank=rank,
                           rope_dim=rope)
    blocks_per = [-(-n // block_size) for n in lens]
    pool = KVTensorPool(spec, sum(blocks_per) + 3)
    ids = torch.randperm(pool.num_blocks, generator=g).tolist()
    tables, slots, ctx = [], [], []
    for n, nb in zip(lens, blocks_per):
        table, ids = ids[:nb], ids[nb:]
        latents = torch.randn(n, rank + rope, generator=g)
        for p in range(n):
            pool.layers[0][0][table[p // block_size], p % block_size, 0] = latents[p]
        tables.append(table)
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
        ctx.append(latents)
    decodes = [SequenceSlice(i, 1, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    meta = AttentionMetadata(torch.tensor(slots), [], decodes, 0)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.2
    proj = MLAProjections.of(kv_b, heads, nope, v_dim)
    q_nope = torch.randn(len(lens), heads, nope, generator=g)
    q_rope = torch.randn(len(lens), heads, rope, generator=g)
    new = torch.stack([c[-1] for c in ctx])
    return pool, meta, proj, q_nope, q_rope, new, ctx


@pytest.mark.parametrize("mode", ["absorbed", "decompress"])
def test_decode_equals_per_head_reference(mode):
    lens = [1, 5, 13, 30]
    pool, meta, proj, q_nope, q_rope, new, ctx = decode_setup(lens)
    backend = TorchMLABackend(pool, scale=0.3, decode=mode)
    got = backend.bind(meta)(0, q_nope, q_rope, new, proj)
    for b, n in enumerate(lens):
        want = reference_mla(q_nope[b:b + 1], q_rope[b:b + 1], ctx[b][None], proj.w_uk,
                             proj.w_uv, 0.3, 32)[0]
        assert torch.allclose(got[b].double(), want, atol=1e-5), (mode, n)


def test_bad_decode_mode():
    pool = decode_setup([3])[0]
    with pytest.raises(ValueError, match="absorbed"):
        TorchMLABackend(pool, 0.1, decode="fast")


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_make_model_loads_in_both(tmp_path, arch):
    """`kvserve make-model --arch deepseek_v2|v3` writes a checkpoint transformers loads with no
    missing or unexpected tensor and whose logits kvserve reproduces."""
    import transformers

    from kvserve.worker.model_build import load_model
    from kvserve.model_loader.make_model import make_model

    path = make_model(tmp_path / arch, arch=arch, size="tiny", with_tokenizer=False)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([random_prompts([19], 2048, seed=4)[0]])
    model, config = load_model(path, "float32")
    assert config.moe is not None and (config.mla.q_lora_rank is None) == (arch == "deepseek_v2")
    llm_logits = _logits_through_pool(model, config, ids[0])
    with torch.no_grad():
        want = ref(ids).logits[0]
    assert torch.allclose(llm_logits, want, atol=1e-4, rtol=0), (llm_logits - want).abs().max()


def _logits_through_pool(model, config, ids):
    """All positions' logits of one prefill through the MLA backend over a fresh pool."""
    from kvserve.worker.builder import engine_kv_spec

    spec = engine_kv_spec(config, torch.float32, 16)
    pool = KVTensorPool(spec, 4)
    backend = TorchMLABackend(pool, config.attention_scale)
    n = ids.shape[0]
    meta = AttentionMetadata(torch.arange(n), [SequenceSlice(0, n, n, [0, 1, 2, 3])], [], n)
    with torch.no_grad():
        hidden = model(ids, torch.arange(n), backend.bind(meta))
        return model.compute_logits(hidden)


# -- bad configs: a clear ValueError naming the key ------------------------------------------
BASE_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
               "vocab_size": 512, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": 16, "v_head_dim": 16, "q_lora_rank": None,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(("change", "message"), [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "multiple of n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "even"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope type"),
])
def test_bad_deepseek_config(change, message):
    from kvserve.models.registry import config_from_dict

    with pytest.raises(ValueError, match=message):
        config_from_dict({**BASE_CONFIG, **change})


def test_yarn_is_only_read_for_deepseek():
    from kvserve.models.registry import config_from_dict

    llama = {**BASE_CONFIG, "architectures": ["LlamaForCausalLM"],
             "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        config_from_dict(llama)


def test_v3_multi_token_prediction_layer_is_skipped(tmp_path):
    """A V3 checkpoint with its MTP module (layer num_hidden_layers) loads like transformers
    loads it: the extra layer left out, the logits unchanged."""
    from safetensors.torch import load_file, save_file

    from kvserve.worker.model_build import load_model
    from kvserve.model_loader.make_model import make_model

    path = make_model(tmp_path / "v3", arch="deepseek_v3", size="tiny", with_tokenizer=False)
    tensors = load_file(path / "model.safetensors")
    before = load_model(path, "float32")[0]
    extra = {k.replace("model.layers.1.", "model.layers.2."): v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.1.")}
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    after, config = load_model(path, "float32")
    ids = torch.tensor(random_prompts([11], 2048, seed=1)[0])
    assert torch.equal(_logits_through_pool(before, config, ids),
                       _logits_through_pool(after, config, ids))


def test_planner_report_shows_the_mla_saving():
    from kvserve.planner.memory import make_plan
    from kvserve.planner.model import ModelSpec
    from kvserve.planner.report import format_plan

    text = format_plan(make_plan(ModelSpec.load("deepseek-v2")))
    assert "MLA latent cache: 576 values per token per layer vs 40,960" in text
    assert "71.1x" in text


def test_warm_up_compiles_every_packed_shape(checkpoints):
    """`kvserve serve` warms the GEMM shapes up front: for DeepSeek the first (dense) layer and
    the first MoE layer's shared experts; the model's output is unchanged afterwards."""
    from kvserve.worker.model_build import load_model

    model, config = load_model(checkpoints["v2_qlora_dense"], "float32")
    ids = torch.tensor(random_prompts([9], VOCAB, seed=2)[0])
    before = _logits_through_pool(model, config, ids)
    if not model.packed:
        assert warm_up_gemms(model, 64, 8) == 0
        return
    assert warm_up_gemms(model, 64, 8, max_flops=0) == 0
    assert warm_up_gemms(model, 64, 8) == 16 + 8 + 8  # 1..16, 8 sizes to 32, 8 more to 64
    assert [type(layer.mlp).__name__ for layer in model.warm_up_layers()] == ["SwiGLU"]
    moe_model = load_model(checkpoints["v2_moe"], "float32")[0]
    assert [type(layer.mlp).__name__ for layer in moe_model.warm_up_layers()] == ["SwiGLU",
                                                                               "MoE"]
    assert warm_up_gemms(moe_model, 32, 8) > 0
    assert torch.equal(_logits_through_pool(model, config, ids), before)


def test_the_planner_reads_an_omitted_q_lora_rank_as_transformers_does():
    """A DeepSeek-V2 config without `q_lora_rank`: transformers (and the engine's parse_mla)
    take 1536, a q bottleneck; the planner's parameter count must too (it read a full q_proj)."""
    import transformers

    from kvserve.planner.model import estimate_params

    cfg = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1)
    assert cfg.q_lora_rank == 1536
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = cfg.to_dict()
    del d["q_lora_rank"]
    params = sum(p.numel() for p in model.parameters())
    assert estimate_params(d) == pytest.approx(params, rel=5e-3)
