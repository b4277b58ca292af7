"""Quantized KV cache: fp8 (e4m3, e5m2), int8 and int4 (KIVI).

1. Round trips through the pool stay within each format's error bound (written from the
   format's definition: fp8's mantissa, the affine step of int8/int4).
2. For each dtype the engine's greedy tokens equal those of a plain-PyTorch reference of the
   same scheme run on transformers' weights (transformers' own model with an attention function
   that fake-quantizes K/V as the scheme says), and the engine's logprobs agree with it; for a
   sliding-window model too (Qwen2 layer_types), past its window, where the reference applies
   the window and a reference without it differs (the quantized path honours windows; that
   model runs with per-group block tables, the hybrid layout).
3. Capacity: tokens per pool equal `kvserve plan`'s figure and the textbook bytes.
4. Prefix caching and the storage tiers serve quantized blocks: the same tokens as from the
   device pool, with chunks of the quantized size.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvserve
from kvserve import LLM, SamplingParams
from kvserve.kv.spec import KVStorage, decoder_kv_spec
from kvserve.kv.tensors import KVTensorPool
from kvserve.attention import cpu_paged

MODEL = Path(kvserve.__file__).parent / "assets" / "stdlib-coder"
QUANTIZED = ["fp8", "fp8_e5m2", "int8", "int4"]
BS = 16
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8": 448.0, "fp8_e5m2": 57344.0}
MANTISSA_BITS = {"fp8": 3, "fp8_e5m2": 2}
SUBNORMAL_STEP = {"fp8": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}


# -- the schemes, from their definitions ----------------------------------------------------
def ref_fp8(x: torch.Tensor, scale: float, name: str) -> torch.Tensor:
    y = torch.clamp(x / scale, -FP8_MAX[name], FP8_MAX[name])
    return y.to(FP8[name]).to(torch.float32) * scale


def ref_affine(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Min/max affine quantization along `dim`, scale and zero rounded to fp16 first."""
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    levels = 2 ** bits - 1
    scale = ((hi - lo) / levels).half().float()
    zero = lo.half().float()
    codes = torch.round((x - zero) / torch.where(scale > 0, scale, 1.0)).clamp(0, levels)
    return codes * scale + zero


def affine_bound(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Half a step of the group, plus fp16's rounding of scale and zero."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (hi - lo) / (2 ** bits - 1)
    return 0.5 * step * (1 + 2 ** -8) + 2 ** -10 * torch.maximum(lo.abs(), hi.abs()) + 1e-6


@pytest.fixture
def kvserve_log():
    """Messages of the kvserve logger (it may not propagate to the root, so caplog misses it)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("kvserve")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


# -- 1. round trips through the pool --------------------------------------------------------
def _pool(name: str, heads=2, head_dim=64, layers=2, blocks=8) -> KVTensorPool:
    storage = KVStorage(name, key_group_tokens=BS if name == "int4" else None)
    return KVTensorPool(decoder_kv_spec(layers, heads, head_dim, storage, BS), blocks)


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_format_bound(name):
    torch.manual_seed(0)
    pool = _pool(name)
    seq_len = 3 * BS + 5  # three whole blocks and a partial one
    table = [5, 1, 6, 2]
    k = torch.randn(seq_len, 2, 64) * 3
    k[:, :, 7] += 20  # an outlier channel, as keys have
    v = torch.randn(seq_len, 2, 64)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq_len)])
    step = pool.begin_step([(table, 0, seq_len)], seq_len)
    pool.store(1, k, v, slots, step)
    blocks = torch.tensor(table)
    kk, vv = pool.gather(1, blocks, torch.float32, pool.state_lookup(blocks))
    kk, vv = kk.reshape(-1, 2, 64)[:seq_len], vv.reshape(-1, 2, 64)[:seq_len]
    if name in FP8:
        for x, y in ((k, kk), (v, vv)):
            rel = 2.0 ** -(MANTISSA_BITS[name] + 1)
            assert ((y - x).abs() <= torch.clamp(rel * x.abs(), min=SUBNORMAL_STEP[name] / 2)
                    + 1e-7).all()
            assert torch.equal(y, ref_fp8(x, 1.0, name))
    elif name == "int8":
        for x, y in ((k, kk), (v, vv)):
            assert ((y - x).abs() <= affine_bound(x, 8, -1)).all()
        assert (vv - v).abs().max() < 0.02  # 8 bits over a spread of ~6: about 0.012
    else:
        assert ((vv - v).abs() <= affine_bound(v, 4, -1)).all()
        full = 3 * BS
        kb = k[:full].reshape(3, BS, 2, 64)
        bound = affine_bound(kb, 4, 1).expand_as(kb).reshape(full, 2, 64)
        assert ((kk[:full] - k[:full]).abs() <= bound).all()
        # per channel: the outlier channel's wide range does not spoil the others
        assert (kk[:full] - k[:full])[:, :, :7].abs().max() < 2.0
        assert torch.equal(kk[full:], k[full:])  # the partial block: the residual, exact
    # the other layer is untouched
    k0, _ = pool.gather(0, blocks, torch.float32, pool.state_lookup(blocks))
    assert not k0.any()


def test_int4_decode_fills_a_block_then_quantizes_it_once():
    """Token by token: the filling block's keys stay exact (residual); the write of its last slot
    quantizes the block's keys as a group, equal to the reference; the row is released."""
    torch.manual_seed(1)
    pool = _pool("int4", layers=1)
    table = [3, 4]
    k = torch.randn(BS + 2, 2, 64)
    v = torch.randn(BS + 2, 2, 64)
    for p in range(BS + 2):
        step = pool.begin_step([(table, p, p + 1)], 1)
        pool.store(0, k[p:p + 1], v[p:p + 1], torch.tensor([table[p // BS] * BS + p % BS]), step)
        blocks = torch.tensor(table)
        kk, _ = pool.gather(0, blocks, torch.float32, pool.state_lookup(blocks))
        kk = kk.reshape(-1, 2, 64)
        if p < BS - 1:
            assert torch.equal(kk[:p + 1], k[:p + 1])
        else:
            want = ref_affine(k[:BS].permute(1, 2, 0), 4, -1).permute(2, 0, 1)
            assert torch.allclose(kk[:BS], want, atol=1e-6)
            assert torch.equal(kk[BS:p + 1], k[BS:p + 1])
    assert list(pool.codecs[0].residual.rows) == [4]  # only the filling block holds a row
    pool.release(table)  # the request let go of its blocks (the step plan's `released`)
    assert not pool.codecs[0].residual.rows


def test_only_a_format_with_block_state_names_freed_blocks():
    """int4's residual rows are its codecs' block state (one shared by every layer); only such
    a pool asks the manager to record freed blocks for the step plan, so another format's
    plans never carry `released` (no per-step cost)."""
    from kvserve.kv.manager import KVCacheManager
    from kvserve.request import Request

    for name in ["bf16", *QUANTIZED]:
        pool = _pool(name)
        states = {id(c.block_state) for c in pool.codecs}
        assert pool.keeps_block_state == (name == "int4"), name
        if name == "int4":
            assert states == {id(pool.block_state)}, "one residual for every layer"
        kv = KVCacheManager(8, BS, track_released=pool.keeps_block_state)
        seq = Request("r", list(range(BS + 1)), SamplingParams(), max_tokens=1)
        assert kv.allocate_slots(seq, BS + 1)
        kv.free(seq)
        assert sorted(kv.end_step().released) == ([0, 1] if name == "int4" else []), name


def test_pool_allocates_the_textbook_bytes():
    """What the pool allocates is the bytes counted by hand from the formats (codes, scales and
    zero points), not whatever its own spec says."""
    for name in ["bf16", *QUANTIZED]:
        pool = _pool(name, heads=2, head_dim=64, layers=2, blocks=5)
        allocated = sum(t.numel() * t.element_size() for layer in pool.layers for t in layer)
        assert allocated == 5 * BS * _textbook_bytes_per_token(name, 2, 2, 64), name


def test_unknown_kv_cache_dtype_is_refused_with_the_list():
    with pytest.raises(ValueError, match="fp8_e5m2.*int8.*int4.*got 'fp6'"):
        LLM(model=str(MODEL), kv_cache_dtype="fp6")
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        LLM(model=str(MODEL), kv_cache_dtype=8)


# -- 2. the engine against the reference ----------------------------------------------------
class _RefConfig:
    name = "auto"
    scales: torch.Tensor | None = None  # [layers, 2]
    prompt_len = 0
    ignore_window = False  # the control: the same scheme without the layers' windows


REF = _RefConfig()


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    """Attention over K/V stored as REF.name says, for one unpadded sequence processed by the
    engine as one prefill of REF.prompt_len tokens and then one decode per token. A sliding
    layer (transformers passes its `sliding_window`) sees keys q - W < k <= q."""
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [H, s, D], [Hkv, s, D]
    name, layer = REF.name, module.layer_idx
    s = k.shape[1]
    full_k = None
    if name in FP8:
        ks, vs = (1.0, 1.0) if REF.scales is None else REF.scales[layer].tolist()
        k, v = ref_fp8(k, ks, name), ref_fp8(v, vs, name)
    elif name == "int8":
        k, v = ref_affine(k, 8, -1), ref_affine(v, 8, -1)
    elif name == "int4":
        v = ref_affine(v, 4, -1)
        full_k = k
        k = k.clone()
        whole = s // BS * BS
        if whole:
            tiles = k[:, :whole].reshape(k.shape[0], -1, BS, k.shape[2])
            k[:, :whole] = ref_affine(tiles, 4, 2).reshape(k.shape[0], whole, k.shape[2])
    group = q.shape[0] // k.shape[0]
    scores = q @ k.repeat_interleave(group, 0).transpose(1, 2) * scaling
    pos_q = torch.arange(s)[:, None]
    pos_k = torch.arange(s)[None, :]
    if full_k is not None:
        # A key is read quantized once its block has been filled by the step that processes
        # the query: the prompt's prefill, then one token per decode step.
        done = (pos_k // BS + 1) * BS <= torch.clamp(pos_q + 1, min=REF.prompt_len)
        exact = q @ full_k.repeat_interleave(group, 0).transpose(1, 2) * scaling
        scores = torch.where(done, scores, exact)
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    window = kwargs.get("sliding_window")
    if window is not None and not REF.ignore_window:
        scores = scores.masked_fill(pos_k <= pos_q - window, float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(group, 0)
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def _load_reference(path):
    """transformers' model of the checkpoint, its attention replaced by the reference."""
    import transformers
    from transformers import AttentionInterface

    AttentionInterface.register("kvserve_quant_reference", _reference_attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="kvserve_quant_reference")
    model.eval()
    return model


@pytest.fixture(scope="module")
def reference_model():
    return _load_reference(MODEL)


@pytest.fixture(scope="module")
def prompts():
    from kvserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(MODEL)
    texts = [("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and "
              "run the command.\"\"\"\n    parser = argparse.ArgumentParser("),
             ("class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push("
              "self, item):\n        self._items.append(item)\n\n    def pop(self):\n        "
              "return self._items.pop()\n\n    def peek(self):\n        return self.")]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


NEW_TOKENS = 40
# Engine and reference compute K in a different order, so once in a while an element sits on a
# rounding boundary of the format and lands on the neighbouring code: a logprob moves by ~1e-3.
# The quantization itself moves them by far more (checked below, per dtype).
TOLERANCE = 5e-3


def _paged_decode_calls(llm) -> list:
    """The backend's decodes through the paged C++ kernel: the number of sequences of each
    layer call, called from Python or handed to the one-call decode (fast_decode.py) as
    kernel arguments."""
    backend, calls = llm.engine.backend, []
    inner, inner_args = backend._decode_paged, backend.kernel_args

    def counted(*args):
        calls.append(len(args[3].decodes))  # (layer, q, out, meta, paged)
        return inner(*args)

    def counted_args(*args):
        kernel_args = inner_args(*args)
        if kernel_args is not None:
            calls.append(len(args[5].decodes))  # (layer, q, k, v, out, meta, step)
        return kernel_args

    backend._decode_paged = counted
    backend.kernel_args = counted_args
    return calls


def _check_against_reference(model, llm, prompts, name):
    scales = None
    kernel_calls = _paged_decode_calls(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1,
                                       ignore_eos=True), use_tqdm=False)
    if name == "fp8":  # what the engine used (calculate_kv_scales: known after the first step)
        scales = llm.engine.tensors.scales.values.clone()
    worst = effect = 0.0
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        REF.prompt_len = len(prompt)
        REF.name, REF.scales = name, scales if name == "fp8" else None
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        REF.name = "auto"
        with torch.no_grad():
            exact = model(torch.tensor([prompt + gen])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        exact = torch.log_softmax(exact[len(prompt) - 1:-1], -1)
        for i, token in enumerate(gen):
            top2 = logprobs[i].topk(2)
            if int(top2.indices[0]) != token:  # only a near-tie may go the other way
                assert float(top2.values[0] - logprobs[i, token]) < TOLERANCE, (name, i)
            engine_lp = out.outputs[0].logprobs[i][token]
            worst = max(worst, abs(engine_lp - float(logprobs[i, token])))
            effect = max(effect, abs(float(exact[i, token] - logprobs[i, token])))
    print(f"{name}: engine vs reference {worst:.2e}, quantization's own effect {effect:.2e}")
    if cpu_paged.load_kernel() is not None:  # every layer's decodes went through the kernel
        layers = len(llm.engine.tensors.layers)
        assert sum(kernel_calls) == layers * len(prompts) * (NEW_TOKENS - 1), name
    assert worst < TOLERANCE, (name, worst)
    return worst, effect


@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
def test_greedy_equals_the_reference_scheme(name, reference_model, prompts):
    llm = LLM(model=str(MODEL), dtype="float32", kv_cache_dtype=name, block_size=BS,
              max_model_len=512, kv_cache_memory_bytes=32 * 2**20, enable_prefix_caching=False)
    _check_against_reference(reference_model, llm, prompts, name)


WINDOW = 32


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory):
    """Qwen2 with `layer_types` (test_window_parity's config): sliding layers of 32 tokens
    around a full-attention one, random weights."""
    transformers = pytest.importorskip("transformers")
    from helpers import save_random_checkpoint

    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0,
        eos_token_id=2, pad_token_id=0, num_hidden_layers=3, use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True, rope_theta=1e6)
    return save_random_checkpoint(config, tmp_path_factory.mktemp("qwen2-window"), seed=3,
                                  perturb_norms=True)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_windowed_model_equals_the_reference_scheme(name, windowed_checkpoint):
    """Sequences of up to 4.5 windows, prefilled in chunks whose context passes the window (a
    chunk's gather then starts blocks in) and decoded far past it: the engine equals the
    reference of the quantized scheme with each sliding layer's window; the same reference
    without the windows is far off there, so a quantized path that read past a window fails."""
    import random

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (120, 45)]
    model = _load_reference(windowed_checkpoint)
    llm = LLM(model=str(windowed_checkpoint), dtype="float32", kv_cache_dtype=name,
              block_size=BS, max_model_len=512, max_num_batched_tokens=56,
              kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=False)
    assert set(llm.engine.backend.windows) == {WINDOW, None}
    assert llm.engine.tensors.quantized
    # The hybrid layout: per-group tables over shared slot tensors, each layer's own codec.
    assert llm.engine.kv.num_groups == 3 and len(llm.engine.tensors.storage()) == 1
    _check_against_reference(model, llm, prompts, name)
    # The control, on the first prompt's sequence (past the window from its first token on).
    out = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    seq = prompts[0] + list(out[0].outputs[0].token_ids)
    REF.name, REF.prompt_len = name, len(prompts[0])
    REF.scales = llm.engine.tensors.scales.values.clone() if name == "fp8" else None
    try:
        with torch.no_grad():
            windowed = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
            REF.ignore_window = True
            full = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
    finally:
        REF.name, REF.ignore_window = "auto", False
    rows = slice(len(prompts[0]) - 1, len(seq) - 1)
    assert (windowed[rows] - full[rows]).abs().max() > 20 * TOLERANCE, \
        "the reference's windows change nothing here: this test could not fail"


def test_quantization_changes_the_output_distribution(reference_model, prompts):
    """The reference is not vacuous: int4's logits differ from the unquantized model's."""
    REF.prompt_len = len(prompts[0])
    outs = {}
    for name in ("auto", "int4"):
        REF.name = name
        with torch.no_grad():
            outs[name] = reference_model(torch.tensor([prompts[0]])).logits[0]
    assert (outs["auto"] - outs["int4"]).abs().max() > 1e-2


def test_fp8_scales_calculated_from_the_first_batch(reference_model, prompts):
    llm = LLM(model=str(MODEL), dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
              block_size=BS, max_model_len=512, kv_cache_memory_bytes=32 * 2**20)
    scales = llm.engine.tensors.scales
    assert not any(scales.calibrated)
    _check_against_reference(reference_model, llm, prompts, "fp8")
    assert all(scales.calibrated) and (scales.values != 1.0).all()


def _with_scales(tmp_path, scales: dict[str, float]) -> Path:
    out = tmp_path / "model"
    shutil.copytree(MODEL, out)
    weights = load_file(out / "model.safetensors")
    weights.update({k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_fp8_scales_from_the_checkpoint(tmp_path, reference_model, prompts):
    layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    given = torch.tensor([[0.05 + 0.01 * i, 0.02 + 0.005 * i] for i in range(layers)])
    names = {}
    for i in range(layers):  # two of vLLM's spellings
        names[f"model.layers.{i}.self_attn.k_scale"] = float(given[i, 0])
        names[f"model.layers.{i}.self_attn.v_proj.v_scale"] = float(given[i, 1])
    path = _with_scales(tmp_path, names)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp8", block_size=BS,
              max_model_len=512, kv_cache_memory_bytes=32 * 2**20)
    assert torch.allclose(llm.engine.tensors.scales.values, given)
    _check_against_reference(reference_model, llm, prompts, "fp8")
    # auto ignores them (the checkpoint still loads); a partial set is refused
    LLM(model=str(path), dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20)
    del names["model.layers.1.self_attn.k_scale"]
    partial = _with_scales(tmp_path / "partial", names)
    with pytest.raises(ValueError, match="layer 1 k_scale"):
        LLM(model=str(partial), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
            kv_cache_memory_bytes=2**20)


def test_fp8_without_scales_warns(kvserve_log):
    LLM(model=str(MODEL), dtype="float32", kv_cache_dtype="fp8", max_model_len=64,
        kv_cache_memory_bytes=2**20)
    assert any("without k_scale/v_scale" in r.getMessage() and r.levelno == logging.WARNING
               for r in kvserve_log)


# -- 3. capacity ----------------------------------------------------------------------------
def _textbook_bytes_per_token(name: str, layers: int | None = None, heads: int | None = None,
                              d: int | None = None) -> int:
    """Bytes of one token's K and V in every layer, counted from the formats' definitions
    (the trained model's shapes unless given)."""
    cfg = json.loads((MODEL / "config.json").read_text())
    layers = layers or cfg["num_hidden_layers"]
    heads = heads or cfg["num_key_value_heads"]
    d = d or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_head = {"bf16": 2 * 2 * d, "fp8": 2 * d, "fp8_e5m2": 2 * d,
                "int8": 2 * (d + 4),  # codes + fp16 scale and zero per vector
                # values as int8 at 4 bits; keys: 4 bits + per channel scale/zero over 16 tokens
                "int4": (d // 2 + 4) + (d // 2 + 4 * d // BS)}[name]
    return layers * heads * per_head


def test_capacity_equals_the_planner_and_the_bytes(kvserve_log):
    from kvserve.planner import make_plan
    from kvserve.planner.model import ModelSpec
    from kvserve.server.metrics import PrometheusStatLogger

    budget = 3 * 2**20 + 12345
    spec = ModelSpec.load(str(MODEL / "config.json"))
    tokens = {}
    for name in ["bf16", *QUANTIZED]:
        llm = LLM(model=str(MODEL), dtype="bfloat16", kv_cache_dtype=name, block_size=BS,
                  max_model_len=2048, kv_cache_memory_bytes=budget)
        engine = llm.engine
        tokens[name] = engine.kv.num_blocks * BS
        per_token = _textbook_bytes_per_token(name)
        assert tokens[name] == budget // (per_token * BS) * BS, name
        plan = make_plan(spec, kv_dtype=name, context_len=2048, kv_cache_memory=budget,
                         block_size=BS)
        assert plan["capacity"]["kv_cache_tokens"] == tokens[name], name
        line = f"KV cache size: {tokens[name]:,} tokens"
        assert any(r.getMessage().startswith(line) for r in kvserve_log), name
        metrics = PrometheusStatLogger("m")
        metrics.on_idle(engine.stats())
        text = metrics.render().decode()
        assert f'kvserve:kv_cache_size_tokens{{model_name="m"}} {float(tokens[name])}' in text
        assert f'cache_dtype="{name}"' in text
    # per KV head and token, bf16 K + V = 256 bytes: 2x for fp8; int8 pays 4 bytes of scale per
    # 64-element vector; int4 32 + 4 bytes per value and 32 + 64 x 4 / 16 per key
    assert tokens["fp8"] / tokens["bf16"] == pytest.approx(2.0, rel=0.01)
    assert tokens["int8"] / tokens["bf16"] == pytest.approx(256 / (2 * 68), rel=0.01)
    assert tokens["int4"] / tokens["bf16"] == pytest.approx(256 / (36 + 48), rel=0.01)


# -- 4. prefix caching and tiers on quantized blocks ----------------------------------------
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("partial", [False, True])
def test_prefix_cache_hits_decode_like_a_cold_run(name, partial, prompts):
    """A shared prefix served from the cache gives the cold run's tokens: whole blocks for
    every dtype; a match that ends inside a block (copy-on-write of the block) for the per-token
    formats. int4's copied keys are re-quantized with the block (kv/quant.py), so there the
    copy is only checked to be served."""
    shared = prompts[1][:2 * BS]
    tail = prompts[0]
    assert tail[4] != tail[0]
    second = tail[:5] + tail[8:20] if partial else tail[4:20]
    batch = [shared + tail[:7], shared + second]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(caching: bool):
        llm = LLM(model=str(MODEL), dtype="float32", kv_cache_dtype=name, block_size=BS,
                  max_model_len=256, kv_cache_memory_bytes=8 * 2**20,
                  enable_prefix_caching=caching)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                for p in batch]
        return [o.outputs[0].token_ids for o in outs], outs[1].num_cached_tokens

    cold, _ = run(False)
    warm, cached = run(True)
    assert cached == 2 * BS + (5 if partial else 0)
    if not (partial and name == "int4"):
        assert warm == cold


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_tiers_serve_quantized_chunks(name, hf_checkpoints, tmp_path):
    """Documents evicted to host memory or disk come back as the quantized bytes and scales,
    and decode to the tokens the device pool gives when it holds everything."""
    import random

    from kvserve.planner.memory import kv_bytes_per_token
    from kvserve.planner.model import ModelSpec

    path = hf_checkpoints["qwen3"]
    rng = random.Random(5)
    docs = [[rng.randrange(3, 500) for _ in range(150)] for _ in range(3)]
    qs = [[[rng.randrange(3, 500) for _ in range(10)] for _ in range(2)] for _ in range(3)]
    pass_a = [{"prompt_token_ids": d + q[0]} for d, q in zip(docs, qs)]
    pass_b = [{"prompt_token_ids": d + q[1]} for d, q in zip(docs, qs)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    per_token = kv_bytes_per_token(ModelSpec.load(str(path / "config.json")), name,
                                   key_group_tokens=BS)

    def run(pool_tokens: int, tiers: dict | None):
        llm = LLM(model=str(path), dtype="float32", kv_cache_dtype=name, block_size=BS,
                  max_model_len=512, kv_cache_memory_bytes=pool_tokens * per_token,
                  kv_tier_config=None if tiers is None else {"chunk_size": 32, **tiers})
        a = [o.outputs[0].token_ids for o in llm.generate(pass_a, params, use_tqdm=False)]
        if tiers is not None:
            assert llm.engine.tiers.flush()
        b = [o.outputs[0].token_ids for o in llm.generate(pass_b, params, use_tqdm=False)]
        return llm, a, b

    _, want_a, want_b = run(4096, None)
    for kind, tiers in (("host", {"local_cpu": True, "max_local_cpu_size": 0.01}),
                        ("disk", {"local_cpu": False, "local_disk": str(tmp_path / name),
                                  "max_local_disk_size": 0.01})):
        llm, a, b = run(192, tiers)
        assert (a, b) == (want_a, want_b), kind
        stats = llm.engine.stats()
        assert stats.hit_tokens[kind] >= 2 * 4 * 32, (kind, stats)
        identity = llm.engine.tiers.identity
        assert identity.chunk_bytes == 32 * per_token  # exactly the quantized bytes
        # what moved: the loaded chunks at the quantized size (plus a small frame header)
        loaded = llm.engine.tier_stats()["bytes_loaded"][kind]
        chunks = stats.hit_tokens[kind] // 32
        assert chunks * identity.chunk_bytes <= loaded <= chunks * (identity.chunk_bytes + 128)
        llm.engine.shutdown()


def test_calculated_scales_and_tiers_do_not_mix():
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        LLM(model=str(MODEL), kv_cache_dtype="fp8", calculate_kv_scales=True,
            kv_tier_config={"chunk_size": 32, "local_cpu": True})


def test_ratio_figures_are_consistent():
    """The spec's int4 bytes per token equal the textbook KIVI count for stdlib-coder."""
    cfg = json.loads((MODEL / "config.json").read_text())
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    spec = decoder_kv_spec(cfg["num_hidden_layers"], cfg["num_key_value_heads"], d,
                           KVStorage("int4", key_group_tokens=BS), BS)
    assert spec.bytes_per_token == _textbook_bytes_per_token("int4")
    assert math.isclose(spec.data_bytes_per_token, _textbook_bytes_per_token("fp8") / 2)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_a_tier_hit_that_starts_inside_a_chunk(name, hf_checkpoints):
    """The device holds a chunk's first two blocks (another request computed them), host memory
    the whole chunk: the load skips those two blocks. For a packed pool (int8, int4: a chunk
    counts blocks, not tokens, along that axis) the cut once took 2 x block_size blocks, and the
    step raised on a load of the wrong shape."""
    import random

    path = hf_checkpoints["llama"]
    rng = random.Random(3)
    a = [rng.randrange(3, 500) for _ in range(41)]
    b = a[:8] + [rng.randrange(3, 500) for _ in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def llm(**kw) -> LLM:
        return LLM(model=str(path), dtype="float32", kv_cache_dtype=name, block_size=4,
                   max_model_len=128, **kw)

    cold = llm(enable_prefix_caching=False)
    want = cold.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0]
    tiered = llm(kv_tier_config={"chunk_size": 16, "write_policy": "write_through"})
    tiered.generate([{"prompt_token_ids": a}], params, use_tqdm=False)
    tiered.reset_prefix_cache()  # the device forgets, host memory keeps a's chunks
    tiered.generate([{"prompt_token_ids": b}], params, use_tqdm=False)  # a's blocks 0 and 1
    got = tiered.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0]
    hits = tiered.engine.stats().hit_tokens
    assert got.error is None and got.num_cached_tokens == 32
    assert hits["device"] >= 8 and hits["host"] == 24
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
