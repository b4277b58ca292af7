"""Issue 47, acceptance 1: how a model computes is decided when it is built. Nothing outside a
constructor assigns a part's method or replaces a submodule afterwards: the modules are walked
right after `CausalLM.__init__` returns and again after `LLM()` (and a few generated tokens)
in each execution mode, and must be the same objects with the same attributes.

What may change after construction is data, not behaviour: parameters and buffers (a method
packs or quantizes the weights it reads and frees the dense copy it no longer needs), and
the state inside a method object that `prepare` makes from the loaded weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_hf_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.utils.quant_formats import FileBlocks
from kvserve.layers.cpu_linear import gemv_available, onednn_available
from kvserve.kernels.cpu import panel_gemm
from kvserve.models.decoder import CausalLM

CPU = torch.device("cpu")
# What a part holds as data: tensors, and a file's blocks of a weight (a projection's
# `file_blocks`, handed over by the loader: bytes, not behaviour). An attribute that is None
# is left out of a walk, so one that gets an object later shows as added.
DATA = (torch.Tensor, FileBlocks)


def shape_of(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every module (by name): its type and identity, and the identity of each public
    attribute that is not a tensor (methods, method lists, configs, plans, settings)."""
    out = {}
    for name, module in model.named_modules():
        attrs: dict[str, object] = {"<module>": (type(module).__name__, id(module))}
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training" or value is None \
                    or isinstance(value, DATA):
                continue
            attrs[key] = (type(value).__name__, id(value))
        out[name] = attrs
    return out


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two `shape_of` walks, as readable lines."""
    found = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            found.append(f"module {name!r} removed")
            continue
        if name not in before:
            found.append(f"module {name!r} added")
            continue
        a, b = before[name], after[name]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                found.append(f"{name or '<model>'}.{key}: {a.get(key)} -> {b.get(key)}")
    return found


def method_objects(model: CausalLM) -> list[int]:
    """The identities of the per-bucket methods the model runs (after `prepare`)."""
    ids = [id(m) for m in model.head.buckets]
    for layer in model.layers:
        method = getattr(layer, "method", None)
        if method is not None:
            ids += [id(m) for m in method.buckets]
    return ids


@pytest.fixture
def constructed(monkeypatch) -> dict[int, dict]:
    """id(model) -> its shape as the constructor left it, for every CausalLM built."""
    shapes: dict[int, dict] = {}
    init = CausalLM.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        shapes[id(self)] = shape_of(self)

    monkeypatch.setattr(CausalLM, "__init__", recording)
    return shapes


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("shape") / "llama")


def _kernels() -> list[str]:
    kernels = ["dense", "auto"]
    if onednn_available(torch.float32, CPU):
        kernels.append("onednn")
    if gemv_available(torch.float32, CPU):
        kernels.append("gemv")
    if panel_gemm.available(torch.float32, CPU):
        kernels.append("panel")
    return kernels


def _check_llm(llm: LLM, constructed: dict) -> None:
    model = llm.engine.model
    assert id(model) in constructed, "the engine's model was not built by CausalLM.__init__"
    built = constructed[id(model)]
    assert not changes(built, shape_of(model)), changes(built, shape_of(model))
    running = method_objects(model)
    assert running, "the model runs no methods"
    llm.generate([{"prompt_token_ids": list(range(3, 40))}] * 3,
                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert not changes(built, shape_of(model)), changes(built, shape_of(model))
    assert method_objects(model) == running


@pytest.mark.parametrize("gemm", _kernels())
def test_each_gemm_plan_is_fixed_at_construction(gemm, llama, constructed, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNEL", gemm)
    llm = LLM(model=str(llama), dtype="float32", max_model_len=128)
    _check_llm(llm, constructed)
    if gemm == "gemv":  # the one-call decode step too, made by the constructor
        assert llm.engine.model.decode_step is not None


def test_quantized_gguf_default_model(constructed):
    llm = LLM(max_model_len=128)
    assert llm.engine.model.gemm_plan.source == "quantized"
    _check_llm(llm, constructed)


def test_quantize_at_load(llama, constructed):
    llm = LLM(model=str(llama), quantization="q8_0", max_model_len=128)
    assert llm.engine.model.layers[0].quant_weights
    _check_llm(llm, constructed)


def test_deepseek_layers(tmp_path, constructed, monkeypatch):
    from kvserve.model_loader.make_model import make_model

    monkeypatch.setenv("KVSERVE_KERNEL", "onednn")
    path = make_model(tmp_path / "ds", arch="deepseek_v2", size="tiny")
    _check_llm(LLM(model=str(path), dtype="float32", max_model_len=128), constructed)


def test_tensor_parallel_rank(llama, constructed):
    """A rank's model (built in this process with a stand-in communicator): its row-parallel
    projections, vocabulary-parallel embedding and head come from the plan it was built
    with, not from a binder."""
    from kvserve.layers.methods import GatheredHead, ReducedDecoder, VocabParallelEmbedding
    from kvserve.layers.plan import TensorParallel
    from kvserve.model_loader.tp_layout import rank_layout
    from kvserve.models.registry import config_from_dir
    from kvserve.worker.model_build import load_model

    class Solo:
        def all_reduce(self, t):
            return t

        def all_gather_last(self, t, sizes):
            return t

    full = config_from_dir(llama)
    layout = rank_layout(full, 0, 2)
    model, _ = load_model(llama, "float32", shard=layout,
                          tp=TensorParallel(Solo(), layout.vocab[0], (1, 1)))
    assert not changes(constructed[id(model)], shape_of(model))
    assert isinstance(model.layers[0].method, ReducedDecoder)
    assert isinstance(model.head, GatheredHead)
    assert isinstance(model.embed, VocabParallelEmbedding)
    assert model.decode_step is None


def test_the_walk_sees_a_binder(llama, constructed):
    """The check can fail: a method assigned after construction, a submodule replaced, and a
    decode step installed are each reported."""
    from kvserve.layers.methods import DenseDecoder

    llm = LLM(model=str(llama), dtype="float32", max_model_len=128)
    model = llm.engine.model
    built = constructed[id(model)]
    model.layers[0].method = DenseDecoder()
    model.decode_step = object()
    model.layers[1] = torch.nn.Identity()
    found = changes(built, shape_of(model))
    assert any("layers.0.method" in line for line in found), found
    assert any("decode_step" in line for line in found), found
    assert any("layers.1" in line for line in found), found
