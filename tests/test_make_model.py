"""make-model's checkpoints in shards (issue 48: an 8B-shaped model's 16 GB never sit in
memory at once): the shards and their index as transformers writes them, read back by
transformers with nothing missing, the same tensors as the one-file checkpoint of the same
seed, and the same model in kvserve as in transformers."""

from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file
from test_model_parity import hf_logits, kv_logits

from kvserve.model_loader import make_model as mm
from kvserve.worker.model_build import load_model


def test_sharded_checkpoint_is_the_same_model(tmp_path, monkeypatch):
    whole = mm.make_model(tmp_path / "whole", "llama", "tiny", seed=4, with_tokenizer=False)
    monkeypatch.setattr(mm, "SHARD_BYTES", 64 << 10)
    monkeypatch.setattr(mm.save_checkpoint, "__defaults__", (64 << 10,))
    sharded = mm.make_model(tmp_path / "sharded", "llama", "tiny", seed=4, with_tokenizer=False)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    one = load_file(str(whole / "model.safetensors"))
    assert set(index["weight_map"]) == set(one)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in one.values())
    parts = {}
    for p in shards:
        parts.update(load_file(str(p)))
    assert all(torch.equal(parts[k], one[k]) for k in one)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(sharded,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model, config = load_model(sharded)
    ids = torch.tensor([5, 17, 99, 240, 31])
    assert (kv_logits(model, config, ids) - hf_logits(hf.eval(), ids)).abs().max() < 1e-4
