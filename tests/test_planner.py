"""The capacity planner: the seed documents' figures, hand-checkable cases for every attention
type and KV dtype, presets against their published parameter counts, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.entrypoints.cli import main
from kvserve.planner import (ModelSpec, fragmentation, kv_bytes_per_request, kv_bytes_per_token,
                             kv_bytes_per_token_layer, make_plan, max_concurrency, weight_bytes)
from kvserve.planner.memory import parse_length_distribution
from kvserve.planner.model import estimate_params
from kvserve.planner.presets import PRESETS
from kvserve.planner.units import parse_bytes, parse_tokens

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 10**9


def preset(name: str) -> ModelSpec:
    return ModelSpec.load(name)


def tiny(**over) -> ModelSpec:
    """2 layers, 4 query heads, head_dim 8 (hidden 32): small enough to check by hand."""
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 100, "max_position_embeddings": 64}
    d.update(over)
    return ModelSpec.from_hf_config(d, "tiny", "test")


# -- the seed documents' figures ----------------------------------------------------------------

def test_llama2_7b_fp16_per_token_and_per_request():
    spec = preset("llama-2-7b")
    assert kv_bytes_per_token(spec, "fp16") == 512 * KiB
    assert kv_bytes_per_request(spec, "fp16", 2048) == 1 * GiB
    assert kv_bytes_per_request(spec, "fp16", 4096) == 2 * GiB


def test_qwen25_7b_fp8_at_8k():
    spec = preset("qwen2.5-7b")
    assert kv_bytes_per_token(spec, "fp8") == 28 * KiB  # 2 x 28 x 4 x 128 x 1
    assert kv_bytes_per_request(spec, "fp8", 8192) == 234_881_024


def test_seed_capacity_example_fp8_awq():
    """80 GB (10^9) x 0.92 - 4.1 GB AWQ weights - 2 GB reserve = 67.5 GB -> 287 requests of 8K
    in fp8 (the seed's 293 divides by a per-request size rounded down to 0.23 GB)."""
    plan = make_plan(preset("qwen2.5-7b"), kv_dtype="fp8", context_len=8192,
                     gpu_memory=parse_bytes("80GB"), gpu_memory_utilization=0.92,
                     weight_format="awq", weights=parse_bytes("4.1GB"),
                     reserve=parse_bytes("2GB"))
    assert plan["memory"]["kv_pool_bytes"] == 67_500_000_000
    assert plan["capacity"]["max_concurrent_requests"] == 287
    assert plan["capacity"]["max_concurrency"] == pytest.approx(287.38, abs=0.005)
    assert math.floor(67.5e9 / 234_881_024) == 287
    assert math.floor(67.5 / 0.23) == 293  # where the seed's figure comes from


def test_seed_capacity_example_fp16():
    plan = make_plan(preset("qwen2.5-7b"), kv_dtype="fp16", context_len=8192,
                     gpu_memory=80 * GB, gpu_memory_utilization=0.92, weights=14 * GB,
                     reserve=2 * GB)
    assert plan["memory"]["kv_pool_bytes"] == 57_600_000_000
    assert plan["capacity"]["max_concurrent_requests"] == 122


def test_vllm_concurrency_figure():
    assert f"{max_concurrency(204_800, 8192):.2f}x" == "25.00x"
    plan = make_plan(preset("llama-3-8b"), context_len=8192, num_gpu_blocks=12_800,
                     block_size=16)
    assert plan["capacity"]["kv_cache_tokens"] == 204_800
    assert f"{plan['capacity']['max_concurrency']:.2f}x" == "25.00x"


def test_gqa_with_8_groups_is_8x_smaller_than_mha():
    gqa = preset("llama-2-70b")  # 64 query heads, 8 KV heads
    mha = ModelSpec.from_hf_config({**PRESETS["llama-2-70b"], "num_key_value_heads": 64},
                                   "70b-mha", "test")
    assert gqa.attention == "gqa" and mha.attention == "mha"
    assert kv_bytes_per_token(mha, "fp16") == 8 * kv_bytes_per_token(gqa, "fp16")


def test_13b_and_70b_rows():
    """The rows a seed table got wrong: 13B is MHA with 40 layers x 5120 (800 KiB/token, not
    1 MB); 70B uses GQA with 8 KV heads (320 KiB/token, not the 2.5 MiB of 64 heads)."""
    assert kv_bytes_per_token(preset("llama-2-13b"), "fp16") == 800 * KiB
    assert kv_bytes_per_request(preset("llama-2-13b"), "fp16", 4096) == 3_355_443_200
    assert kv_bytes_per_token(preset("llama-2-70b"), "fp16") == 320 * KiB
    assert kv_bytes_per_request(preset("llama-2-70b"), "fp16", 4096) == 1_342_177_280
    assert kv_bytes_per_token(preset("llama-3-70b"), "fp16") == 320 * KiB


def test_block_size_fragmentation_seed_figures():
    # The seed's ~1.6% / ~6.4% is half a block per request over 500 tokens ...
    assert fragmentation(16, [500]).rule_of_thumb == pytest.approx(0.016)
    assert fragmentation(64, [500]).rule_of_thumb == pytest.approx(0.064)
    # ... which is what lengths spread around 500 waste on average (tail ~ uniform) ...
    spread = list(range(400, 601))
    assert fragmentation(16, spread).overhead_frac_of_used == pytest.approx(0.016, abs=0.002)
    assert fragmentation(64, spread).overhead_frac_of_used == pytest.approx(0.064, abs=0.004)
    # ... while requests of exactly 500 tokens waste 12 of 512 with either block size.
    assert fragmentation(16, [500]).waste_frac_of_allocated == pytest.approx(12 / 512)
    assert fragmentation(64, [500]).waste_frac_of_allocated == pytest.approx(12 / 512)
    assert fragmentation(16, [512]).expected_waste_tokens == 0


# -- hand-checkable cases: every attention type and dtype -----------------------------------------

# per token per layer: kv_heads x (bytes of one key + one value vector of 8 elements), where
# int8 adds a 4-byte fp16 scale + zero point per vector; int4 (KIVI) does so for values, while
# its keys share one scale + zero point per channel over a group of 16 tokens (the default
# block): 8 x 4 / 16 = 2 bytes per token
VECTOR_BYTES = {"fp32": 2 * 32, "fp16": 2 * 16, "bf16": 2 * 16, "fp8": 2 * 8,
                "fp8_e5m2": 2 * 8, "int8": 2 * (8 + 4), "int4": (4 + 2) + (4 + 4)}


@pytest.mark.parametrize("dtype", list(VECTOR_BYTES))
@pytest.mark.parametrize("kv_heads,kind", [(4, "mha"), (2, "gqa"), (1, "mqa")])
def test_standard_attention_every_dtype(dtype, kv_heads, kind):
    spec = tiny(num_key_value_heads=kv_heads)
    assert spec.attention == kind
    per_layer = kv_heads * VECTOR_BYTES[dtype]
    assert kv_bytes_per_token_layer(spec, dtype) == per_layer
    assert kv_bytes_per_token(spec, dtype) == 2 * per_layer
    assert kv_bytes_per_request(spec, dtype, 10) == 10 * 2 * per_layer
    assert kv_bytes_per_request(spec, dtype, 10, block_size=4) == 12 * 2 * per_layer


# MLA: one latent of kv_lora_rank (16) + rope (4) = 20 elements per token per layer, no V
MLA_BYTES = {"fp32": 80, "fp16": 40, "bf16": 40, "fp8": 20, "int8": 20 + 4, "int4": 10 + 4}


@pytest.mark.parametrize("dtype", list(MLA_BYTES))
def test_mla_every_dtype(dtype):
    spec = tiny(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                q_lora_rank=None)
    assert spec.attention == "mla"
    assert kv_bytes_per_token(spec, dtype) == 2 * MLA_BYTES[dtype]
    # not split by tensor parallelism: every GPU holds the whole latent
    assert kv_bytes_per_token(spec, dtype, tp=4) == 2 * MLA_BYTES[dtype]


def test_deepseek_mla_presets():
    v2, v3 = preset("deepseek-v2"), preset("deepseek-v3")
    assert (v2.attention, v3.attention) == ("mla", "mla")
    assert kv_bytes_per_token(v2, "bf16") == 60 * 576 * 2 == 69_120
    assert kv_bytes_per_token(v3, "bf16") == 61 * 576 * 2 == 70_272
    # an MHA cache of the same 128 heads (K: 192, V: 128 per head) would be ~71x larger
    assert 61 * 128 * (192 + 128) * 2 / 70_272 == pytest.approx(71.1, abs=0.1)


def test_int_group_size_override():
    spec = tiny()
    # int4 values with groups of 4 elements: 8 elements = 4 bytes + 2 groups x 4 bytes; keys
    # per channel over 16 tokens (4 + 8 x 4 / 16 bytes), or over 32 tokens (4 + 1)
    assert kv_bytes_per_token_layer(spec, "int4", group_size=4) == 4 * ((4 + 2) + (4 + 8))
    assert kv_bytes_per_token_layer(spec, "int4", group_size=4, key_group_tokens=32) == \
        4 * ((4 + 1) + (4 + 8))


def test_sliding_window_caps_each_layer():
    spec = tiny(sliding_window=4)  # Mistral-style: every layer
    per_layer = kv_bytes_per_token_layer(spec, "fp16")
    assert spec.num_sliding_layers == 2
    assert kv_bytes_per_request(spec, "fp16", 3) == 2 * 3 * per_layer
    assert kv_bytes_per_request(spec, "fp16", 10) == 2 * 4 * per_layer


def test_hybrid_layer_patterns():
    types = tiny(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    per_layer = kv_bytes_per_token_layer(types, "fp16")
    assert types.windows == (4, None)
    assert kv_bytes_per_request(types, "fp16", 10) == (4 + 10) * per_layer
    gemma2 = tiny(model_type="gemma2", num_hidden_layers=4, sliding_window=4)
    assert gemma2.windows == (4, None, 4, None)
    gemma3 = tiny(model_type="gemma3_text", num_hidden_layers=6, sliding_window=4,
                  sliding_window_pattern=3)
    assert gemma3.windows == (4, 4, None, 4, 4, None)
    qwen = tiny(model_type="qwen2", num_hidden_layers=4, sliding_window=4,
                use_sliding_window=True, max_window_layers=2)
    assert qwen.windows == (None, None, 4, 4)
    assert tiny(model_type="qwen2", sliding_window=4, use_sliding_window=False).windows == \
        (None, None)
    with pytest.raises(ValueError, match="not supported"):
        tiny(layer_types=["mamba", "full_attention"])


def test_real_sliding_window_presets():
    mistral = preset("mistral-7b")
    assert kv_bytes_per_token(mistral, "bf16") == 128 * KiB
    assert kv_bytes_per_request(mistral, "bf16", 32768) == 4096 * 128 * KiB
    gemma = preset("gemma-2-9b")  # 21 sliding (4,096) + 21 global layers, 8 KV heads x 256
    layer = 2 * 8 * 256 * 2
    assert kv_bytes_per_request(gemma, "bf16", 8192) == 21 * layer * (4096 + 8192)
    assert preset("qwen2.5-7b").num_sliding_layers == 0  # use_sliding_window is false


def test_tensor_parallel_splits_kv_heads():
    spec = preset("llama-2-70b")
    assert kv_bytes_per_token(spec, "fp16", tp=8) == 40 * KiB
    assert kv_bytes_per_token(spec, "fp16", tp=16) == 40 * KiB  # heads replicated past 8
    # 8 KV heads over 3 ranks are 3 + 3 + 2 (kvserve/model_loader/tp_layout.py): the largest rank
    # sizes the pool
    assert kv_bytes_per_token(spec, "fp16", tp=3) == 3 * 40 * KiB
    with pytest.raises(ValueError, match="multiple"):
        kv_bytes_per_token(spec, "fp16", tp=12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_pool_bytes_equal_the_planners(hf_checkpoints, arch, dtype):
    """For every architecture the engine loads, the bytes per token its KV tensors really take
    equal what `kvserve plan` computes from the same config.json (both read it through the
    model registry)."""
    from kvserve import LLM

    path = hf_checkpoints[arch]
    llm = LLM(model=str(path), dtype=dtype, kv_cache_memory_bytes=1 << 20, block_size=16)
    engine = llm.engine
    allocated = sum(t.numel() * t.element_size() for layer in engine.tensors.layers
                    for t in layer)
    per_token = allocated // (engine.tensors.num_blocks * 16)
    planned = kv_bytes_per_token(ModelSpec.load(str(path)), dtype)
    assert per_token == engine.kv_spec.bytes_per_token == planned
    assert engine.kv.num_blocks == (1 << 20) // (16 * planned)


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_plan_reads_new_architectures_through_the_registry(tmp_path, capsys, monkeypatch, arch):
    """`kvserve plan <dir>` on make-model's checkpoints of the architectures added through the
    registry: the config is read by the architecture's registry entry (the loader's reading),
    the plan states the architecture, the KV bytes per token (2 layers x K and V x 2 KV heads
    x head_dim 16 x 2 bytes) and the exact parameter count from the safetensors headers."""
    from kvserve.model_loader.make_model import make_model
    from kvserve.models import registry

    path = make_model(tmp_path / arch, arch, "tiny", with_tokenizer=False)
    read: list[str] = []
    real = registry.config_from_dict
    monkeypatch.setattr(registry, "config_from_dict",
                        lambda d: read.append(d["architectures"][0]) or real(d))
    spec = ModelSpec.load(str(path))
    name = registry.by_make_name(arch).name
    assert read == [name] and spec.architecture == name
    assert kv_bytes_per_token(spec, "bf16") == 2 * 2 * 2 * 16 * 2
    assert spec.params_source == "safetensors"
    assert main(["plan", str(path), "--kv-cache-dtype", "bf16", "--max-model-len", "1k"]) == 0
    out = capsys.readouterr().out
    assert f"{name}" in out and "GQA: 2 layers x 2 KV heads x head_dim 16" in out


def test_plan_takes_the_engines_reading_of_a_known_architecture():
    """Qwen3 without a head_dim key: transformers' (and the engine's) 128, not hidden / heads;
    an architecture the engine does not run is still planned from its shape keys."""
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100}
    assert ModelSpec.from_hf_config(qwen3, "q", "test").head_dim == 128
    other = {**qwen3, "architectures": ["SomeNewForCausalLM"], "model_type": "some_new"}
    spec = ModelSpec.from_hf_config(other, "o", "test")
    assert (spec.architecture, spec.head_dim) == ("SomeNewForCausalLM", 16)


def test_planner_reads_the_tiny_checkpoint(tiny_model_dir):
    spec = ModelSpec.load(str(tiny_model_dir))
    assert spec.params_source == "safetensors"
    assert spec.num_params == estimate_params(json.loads((tiny_model_dir / "config.json")
                                                         .read_text()))


# -- weights and the pool -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_match_their_published_parameter_counts(name):
    d = PRESETS[name]
    assert estimate_params(d) == pytest.approx(d["num_params"], rel=2e-3)


def test_weight_formats():
    spec = preset("qwen2.5-7b")
    assert weight_bytes(spec, "bf16") == 2 * 7_615_616_512  # 15.23 GB, not the seed's 14 GB
    embed = 2 * 152064 * 3584
    awq = weight_bytes(spec, "awq", group_size=128)
    assert awq == round(embed * 2 + (spec.num_params - embed) * (0.5 + 2.5 / 128))
    assert 5.5 * GB < awq < 5.7 * GB  # the real AWQ checkpoint is 5.58 GB
    assert weight_bytes(spec, "int8") == round(embed * 2 + (spec.num_params - embed))
    assert weight_bytes(spec, "fp16", tp=2) == spec.num_params
    v3 = preset("deepseek-v3")  # auto: fp8 with 128x128 block scales, from quantization_config
    assert weight_bytes(v3, "auto") == pytest.approx(
        2 * v3.embedding_params + (v3.num_params - v3.embedding_params) * (1 + 4 / 128**2),
        rel=1e-9)


def test_plan_reports_no_room_when_weights_do_not_fit():
    plan = make_plan(preset("llama-2-70b"), gpu_memory=80 * GB)
    assert plan["capacity"]["num_blocks"] == 0
    assert any("no room" in w for w in plan["warnings"])


def test_prefix_room_and_block_table():
    plan = make_plan(preset("qwen2.5-7b"), kv_dtype="fp8", context_len=8192,
                     gpu_memory=80 * GB, gpu_memory_utilization=0.92, weights=int(4.1 * GB),
                     reserve=2 * GB, concurrency=100)
    room = plan["capacity"]["prefix_room"][0]
    assert room["concurrency"] == 100
    assert room["tokens"] == plan["capacity"]["kv_cache_tokens"] - 100 * 8192
    assert plan["block_table"]["bytes_per_request"] == 512 * 4
    assert plan["block_table"]["preallocated_bytes"] == 256 * 512 * 4


def test_length_distributions():
    assert parse_length_distribution("fixed:500") == [500]
    assert parse_length_distribution("uniform:3:5") == [3, 4, 5]
    assert len(parse_length_distribution("lognormal:500:0.5", samples=1000)) == 1000
    with pytest.raises(ValueError):
        parse_length_distribution("zipf:3")


def test_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("4.1e9") == 4_100_000_000
    assert parse_tokens("8k") == 8192
    assert parse_tokens("204800") == 204_800
    with pytest.raises(ValueError):
        parse_bytes("80 parsecs")


def test_config_json_and_bad_inputs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in PRESETS["qwen3-8b"].items() if k != "num_params"}))
    spec = ModelSpec.load(str(tmp_path / "config.json"))
    assert spec.params_source == "estimated"
    assert kv_bytes_per_token(spec, "bf16") == 36 * 2 * 8 * 128 * 2
    with pytest.raises(ValueError, match="neither a preset"):
        ModelSpec.load("no-such-model")
    with pytest.raises(ValueError, match="KV cache dtype"):
        kv_bytes_per_token(spec, "fp6")


# -- the command line -----------------------------------------------------------------------------

SEED_ARGS = ["plan", "qwen2.5-7b", "--kv-cache-dtype", "fp8", "--max-model-len", "8k",
             "--gpu-memory", "80GB", "--gpu-memory-utilization", "0.92",
             "--weight-format", "awq", "--weight-memory", "4.1GB", "--reserve", "2GB"]


def test_cli_table(capsys):
    assert main(SEED_ARGS) == 0
    out = capsys.readouterr().out
    assert "234,881,024 B" in out
    assert "Maximum concurrency for 8,192 tokens per request: 287.38x" in out
    assert "= 287 concurrent requests" in out


def test_cli_json_has_stable_keys(capsys):
    assert main(SEED_ARGS + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == {"model", "kv", "memory", "capacity", "block_table", "fragmentation",
                         "dtypes", "warnings"}
    assert plan["kv"]["bytes_per_request"] == 234_881_024
    assert plan["capacity"]["max_concurrent_requests"] == 287
    assert set(plan["dtypes"]) == {"fp32", "fp16", "bf16", "fp8", "fp8_e5m2", "int8", "int4"}


def test_cli_plot_and_presets(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "deepseek-v3", "-tp", "8", "--gpu", "h200", "--max-model-len", "32k",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "--list-presets"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in PRESETS)
    assert main(["plan", "nonexistent-model"]) == 2
