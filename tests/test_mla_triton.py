"""The MLA Triton decode kernel over the paged latent cache (absorbed) against the per-head
fp64 reference of tests/test_mla.py, under Triton's interpreter without a GPU; and the engine
with attention_backend='triton' on a DeepSeek checkpoint against transformers."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from helpers import generate_checked, hf_greedy, random_prompts  # noqa: E402
from test_mla import decode_setup, make_deepseek_checkpoint, reference_mla  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.mla_triton import TritonMLABackend  # noqa: E402


@pytest.mark.parametrize(("lens", "block_size", "heads"),
                         [([1, 6, 13, 40], 4, 4), ([33, 2], 16, 20), ([17], 1, 3)])
def test_triton_decode_equals_reference(lens, block_size, heads):
    pool, meta, proj, q_nope, q_rope, new, ctx = decode_setup(lens, block_size, heads=heads)
    got = TritonMLABackend(pool, scale=0.3).bind(meta)(0, q_nope, q_rope, new, proj)
    for b in range(len(lens)):
        want = reference_mla(q_nope[b:b + 1], q_rope[b:b + 1], ctx[b][None], proj.w_uk,
                             proj.w_uv, 0.3, 32)[0]
        assert torch.allclose(got[b].double(), want, atol=2e-5), (b, (got[b] - want).abs().max())


def test_engine_with_triton_backend_matches_transformers(tmp_path):
    path = make_deepseek_checkpoint(tmp_path / "v3", v3=True, q_lora_rank=24, n_group=4,
                                    topk_group=2, num_hidden_layers=2)
    prompts = random_prompts([9, 30], 512, seed=2)
    expected = hf_greedy(path, prompts, 4)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16,
              attention_backend="triton")
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
