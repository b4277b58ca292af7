"""Bad GGUF input: each problem is a ValueError that names it, raised before the model is
built, and nothing is left half-made; and the header index that makes later starts fast."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf_files import copy_metadata, finish, gguf_from_checkpoint

from kvserve import LLM
from kvserve.model_loader.gguf_checkpoint import open_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvserve.model_loader.make_model import make_model

    root = tmp_path_factory.mktemp("gguf-errors")
    src = make_model(root / "qwen2", arch="qwen2", size="tiny")
    return src, gguf_from_checkpoint(src, root / "qwen2.gguf")


def _llm(path, **kw):
    return LLM(model=str(path), dtype="float32", max_model_len=128, **kw)


def test_truncated_file(tiny, tmp_path):
    data = tiny[1].read_bytes()
    for cut, says in ((len(data) - 1000, "truncated"), (2000, "truncated or corrupt"),
                      (10, "truncated or corrupt")):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=says):
            _llm(bad)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError):
        _llm(bad)


def _write(path, arch, tensors):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    finish(w)
    return path


def test_unknown_architecture(tmp_path):
    path = _write(tmp_path / "m.gguf", "mamba",
                  {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        _llm(path)


def test_unsupported_tensor_type(tiny, tmp_path):
    """A tensor in a type gguf cannot dequantize (Q8_K, an intermediate type of llama.cpp's
    dot products) is named, with its type, before any weight is read."""
    import gguf

    reader = gguf.GGUFReader(str(tiny[1]))
    path = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    copy_metadata(reader, w)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":  # [128, 64] in torch order: 128 rows of 64
            w.add_tensor(t.name, np.zeros((128, 292), np.uint8), raw_shape=(128, 292),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            w.add_tensor(t.name, np.array(t.data))
    finish(w)
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight.*Q8_K"):
        _llm(path)


def test_no_tokenizer_metadata(tiny, tmp_path):
    src, _ = tiny
    path = gguf_from_checkpoint(src, tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer metadata.*--tokenizer"):
        _llm(path)
    # with a tokenizer given, as vLLM's --tokenizer, it loads
    llm = _llm(path, tokenizer=str(src))
    assert llm.engine.tokenizer.vocab_size == _llm(tiny[1]).engine.tokenizer.vocab_size


def test_header_is_read_once(tiny, monkeypatch):
    """The second open of the same file reads the cached index, not the file's metadata with
    gguf's reader; a changed file is read again."""
    import gguf

    from kvserve.model_loader.gguf_checkpoint import _open

    first = open_gguf(tiny[1])
    assert open_gguf(tiny[1]) is first  # one per process and file version
    _open.cache_clear()  # from here on, a new process: only the cached index on disk

    def refuse(*a, **k):
        raise AssertionError("gguf.GGUFReader called for a file whose index is cached")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    again = open_gguf(tiny[1])
    assert again.config == first.config
    assert {n: t.shape for n, t in again.index.tensors.items()} == \
        {n: t.shape for n, t in first.index.tensors.items()}
    st = os.stat(tiny[1])
    os.utime(tiny[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="GGUFReader called"):  # (wrapped by the reader)
        open_gguf(tiny[1])
