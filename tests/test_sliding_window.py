"""Sliding-window attention below the engine: which layers slide (parsed from every config form,
checked against transformers' own config classes), and both attention backends against a plain
PyTorch reference with transformers' window rule (a query at p sees keys p - W < k <= p).

Blocks that lie wholly before a sequence's window are filled with NaN: a backend that read one
(even under a zero weight) would return NaN, so these tests also prove that a windowed layer
never touches KV outside its window, which is what lets the cache free those blocks.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is first imported), as in tests/test_triton_kernels.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import pool_over  # noqa: E402
from reference_attention import reference_paged_attention  # noqa: E402

from kvserve.attention.base import AttentionMetadata, SequenceSlice  # noqa: E402
from kvserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.models.config import layer_windows  # noqa: E402
from kvserve.models.registry import config_from_dict, config_from_dir  # noqa: E402

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- which layers slide ------------------------------------------------------------------------
_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2)


def _hf_windows(config) -> list[int | None]:
    """Each layer's window as transformers' model classes read them: `layer_types` where the
    config has them, else the config's `sliding_window` on every layer (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return [config.sliding_window] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


HF_CONFIGS = {
    "mistral-window": ("MistralConfig", dict(sliding_window=48)),
    "mistral-null": ("MistralConfig", dict(sliding_window=None)),
    "mistral-default": ("MistralConfig", {}),  # transformers' default window: 4096
    "qwen2-max-window-layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32,
                                                    max_window_layers=2)),
    "qwen2-window-off": ("Qwen2Config", dict(use_sliding_window=False, sliding_window=32)),
    "qwen2-layer-types": ("Qwen2Config", dict(
        use_sliding_window=True, sliding_window=40,
        layer_types=["sliding_attention", "full_attention"] * 3)),
    "qwen3-layer-types": ("Qwen3Config", dict(
        use_sliding_window=True, sliding_window=40, head_dim=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"] * 2)),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_layer_windows_match_transformers_configs(name, tmp_path):
    cls, extra = HF_CONFIGS[name]
    hf = getattr(transformers, cls)(**_SHAPE, **extra)
    hf.save_pretrained(tmp_path)  # the config.json a checkpoint would carry
    ours = config_from_dir(tmp_path)
    assert list(ours.windows) == _hf_windows(hf)


def test_mistral_without_the_key_slides_like_transformers():
    d = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **_SHAPE}
    hf = transformers.MistralConfig(**_SHAPE)
    assert list(layer_windows(d, 6)) == _hf_windows(hf) == [4096] * 6


@pytest.mark.parametrize("d,why", [
    (dict(model_type="qwen2", use_sliding_window=False,
          layer_types=["sliding_attention"] * 2), "needs a sliding_window"),
    (dict(model_type="mistral", sliding_window=0), "positive integer"),
    (dict(model_type="mistral", sliding_window="4k"), "positive integer"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8,
          layer_types=["full_attention"]), "must list 2"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=8,
          layer_types=["full_attention", "linear_attention"]), "not supported"),
])
def test_bad_window_configs_are_refused(d, why):
    with pytest.raises(ValueError, match=why):
        layer_windows(d, 2)


# -- the PyTorch backend -------------------------------------------------------------------------
def _random_cache(num_blocks: int, bs: int, hkv: int, d: int, gen: torch.Generator,
                  device: str = "cpu", dtype: torch.dtype = torch.float32):
    shape = (num_blocks, bs, hkv, d)
    return (torch.randn(shape, generator=gen).to(device, dtype),
            torch.randn(shape, generator=gen).to(device, dtype))


def _poison_outside(caches, table: list[int], first_query: int, window: int, bs: int) -> None:
    """NaN into every block of `table` that lies wholly before the first key any query at
    position >= first_query may see."""
    first_visible = max(0, first_query - window + 1)
    for blk in table[: first_visible // bs]:
        for k, v in caches:
            k[blk] = float("nan")
            v[blk] = float("nan")


# (context, new tokens) per sequence; window 8, so several reach far past it. The last three
# are decodes.
STEP = [(0, 21), (19, 6), (5, 2), (30, 1), (3, 1), (17, 1)]


def _mixed_step(bs: int, window: int, gen: torch.Generator, device: str = "cpu",
                dtype: torch.dtype = torch.float32):
    h, hkv, d = 4, 2, 16
    lens = [c + n for c, n in STEP]
    nb = sum(-(-n // bs) for n in lens) + 3
    caches = [_random_cache(nb, bs, hkv, d, gen, device, dtype)]
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at: at + -(-n // bs)])
        at += len(tables[-1])
    slices, slots, start = [], [], 0
    for (c, n), table in zip(STEP, tables):
        slices.append(SequenceSlice(start, n, c + n, table))
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
        _poison_outside(caches, table, c, window, bs)
        start += n
    n_pre = sum(n for _, n in STEP if n > 1)
    meta = AttentionMetadata(torch.tensor(slots), prefills=[s for s in slices if s.query_len > 1],
                             decodes=[s for s in slices if s.query_len == 1],
                             num_prefill_tokens=n_pre)
    q = torch.randn(start, h, d, generator=gen).to(device, dtype)
    k = torch.randn(start, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(start, hkv, d, generator=gen).to(device, dtype)
    return caches, tables, meta, q, k, v


def _check_against_reference(out, caches, tables, meta, q, window, tol):
    for s, table in zip(meta.prefills + meta.decodes, tables_in_order(meta, tables)):
        rows = slice(s.start, s.start + s.query_len)
        # The reference reads every block (a poisoned one under a zero weight); give it zeros
        # there, which a correct window never sees.
        ref = reference_paged_attention(q[rows].cpu(), caches[0][0].cpu().nan_to_num(0.0),
                                        caches[0][1].cpu().nan_to_num(0.0), table, s.seq_len,
                                        16 ** -0.5, window=window)
        assert torch.isfinite(out[rows]).all(), "a block outside the window was read"
        torch.testing.assert_close(out[rows].cpu().float(), ref, atol=tol, rtol=tol)


def _check_stored(cache, meta, k, v):
    """Every new token's K/V sits in its slot afterwards, prefill rows and decode rows alike
    (the paged kernel stores the decodes' itself; the reference above reads what is stored,
    so only this sees a store that went astray)."""
    hkv, d = k.shape[1:]
    for part, new in zip(cache, (k, v)):
        torch.testing.assert_close(part.view(-1, hkv, d)[meta.slot_mapping].cpu(), new.cpu(),
                                   atol=0, rtol=0)


def tables_in_order(meta, tables):
    """The block tables in the order of meta.prefills + meta.decodes."""
    return [s.block_table for s in meta.prefills + meta.decodes]


@pytest.mark.parametrize("bs", [4, 5, 16])
@pytest.mark.parametrize("window", [8, 13])
def test_torch_backend_windowed_step(bs, window):
    gen = torch.Generator().manual_seed(bs * 100 + window)
    caches, tables, meta, q, k, v = _mixed_step(bs, window, gen)
    backend = TorchAttentionBackend(pool_over(caches, windows=(window,)), 16 ** -0.5)
    out = backend.bind(meta)(0, q, k, v)
    _check_against_reference(out, caches, tables, meta, q, window, 2e-5)
    _check_stored(caches[0], meta, k, v)


def test_torch_backend_mixes_window_and_full_layers():
    """Layer 0 slides, layer 1 attends to everything: each gets its own rule in one step."""
    gen = torch.Generator().manual_seed(7)
    caches, tables, meta, q, k, v = _mixed_step(4, 8, gen)
    full = [(caches[0][0].nan_to_num(0.5), caches[0][1].nan_to_num(0.5))]
    caches2 = caches + full
    backend = TorchAttentionBackend(pool_over(caches2, windows=(8, None)), 16 ** -0.5)
    attend = backend.bind(meta)
    out0 = attend(0, q, k, v)
    out1 = attend(1, q, k, v)
    _check_against_reference(out0, caches, tables, meta, q, 8, 2e-5)
    _check_against_reference(out1, full, tables, meta, q, None, 2e-5)
    _check_stored(caches[0], meta, k, v)
    _check_stored(full[0], meta, k, v)


# -- the Triton kernels ------------------------------------------------------------------------
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,window", [(4, 8), (5, 13), (16, 8)])
def test_triton_backend_windowed_step(bs, window, dtype):
    pytest.importorskip("triton")
    from kvserve.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(bs + window)
    caches, tables, meta, q, k, v = _mixed_step(bs, window, gen, DEVICE, dtype)
    backend = TritonAttentionBackend(pool_over(caches, windows=(window,)), 16 ** -0.5)
    out = backend.bind(meta)(0, q, k, v)
    _check_against_reference(out, caches, tables, meta, q, window, TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_window_with_splits(num_splits):
    """Split-K over the window only: every split inside it, long contexts, a window that is
    not a multiple of the block size or the tile."""
    pytest.importorskip("triton")
    from kvserve.attention import triton_kernels as tk

    gen = torch.Generator().manual_seed(11)
    bs, window, lens = 4, 21, [1, 20, 21, 22, 90]
    nb = sum(-(-n // bs) for n in lens)
    caches = [_random_cache(nb, bs, 1, 16, gen, DEVICE)]
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at: at + -(-n // bs)])
        at += len(tables[-1])
        _poison_outside(caches, tables[-1], n - 1, window, bs)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                          device=DEVICE)
    q = torch.randn(len(lens), 4, 16, generator=gen).to(DEVICE)
    out = tk.decode_attention(q, caches[0][0], caches[0][1], padded,
                              torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.25,
                              num_splits=num_splits, block_n=16, window=window)
    for i, n in enumerate(lens):
        ref = reference_paged_attention(q[i: i + 1].cpu(), caches[0][0].cpu().nan_to_num(0.0),
                                        caches[0][1].cpu().nan_to_num(0.0), tables[i], n, 0.25,
                                        window=window)
        assert torch.isfinite(out[i]).all()
        torch.testing.assert_close(out[i].cpu(), ref[0], atol=2e-5, rtol=2e-5)


def _hybrid_config(arch: str):
    """Layer 0 slides over 16 tokens, layer 1 is full."""
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                 bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**shape, use_sliding_window=True)
    return transformers.Gemma3TextConfig(**shape, head_dim=16, query_pre_attn_scalar=24,
                                         final_logit_softcapping=30.0)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_triton_engine_windowed_greedy_matches_transformers(tmp_path, arch):
    """The engine on the Triton backend (and its fused element-wise ops) with a hybrid window
    layout: chunked prefill next to decodes, prompts past the window."""
    pytest.importorskip("triton")
    from helpers import generate_checked, hf_greedy, random_prompts, save_random_checkpoint

    from kvserve import LLM, SamplingParams

    path = save_random_checkpoint(_hybrid_config(arch), tmp_path / arch, perturb_norms=True)
    prompts = random_prompts([5, 17, 45], 512, seed=21)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, attention_backend="triton",
              device=DEVICE, enforce_eager=True, block_size=4, max_num_batched_tokens=24,
              kv_cache_memory_bytes=16 * 1024**2)
    outputs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("extra,why", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"hidden_activation": "silu"}, "gelu_pytorch_tanh"),
])
def test_gemma3_options_the_engine_does_not_run_are_refused(extra, why):
    d = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_SHAPE,
         "head_dim": 16, "sliding_window": 8, **extra}
    config_from_dict({k: v for k, v in d.items() if k not in extra})  # fine without
    with pytest.raises(ValueError, match=why):
        config_from_dict(d)
