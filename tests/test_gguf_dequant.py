"""kvserve/model_loader/gguf_checkpoint/dequant.py's torch decoding of F16/BF16/Q8_0/Q4_0/Q4_1
against gguf.quants (llama.cpp's own Python reference) on the same bytes, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvserve.model_loader.gguf_checkpoint.dequant import TORCH_TYPES, dequantize  # noqa: E402

SHAPE = (96, 256)  # 8 blocks of 32 per row


def encoded(type_name: str, seed: int) -> np.ndarray:
    """Random weights over a wide range of scales (one row zero, one constant), encoded by
    gguf.quants, as the bytes a GGUF file holds."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(SHAPE).astype(np.float32)
    w *= np.exp(rng.uniform(-6, 3, (SHAPE[0], 1))).astype(np.float32)
    w[3] = 0.0
    w[5] = 1.25
    if type_name == "F32":
        return w.view(np.uint8).reshape(-1)
    qtype = gguf.GGMLQuantizationType[type_name]
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(raw.reshape(SHAPE[0], -1), qtype).reshape(SHAPE)


@pytest.mark.parametrize("type_name", sorted(TORCH_TYPES - {"F32"}))
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_decoding_equals_gguf_quants(type_name, seed):
    raw = encoded(type_name, seed)
    got = dequantize(raw, type_name, SHAPE, "w")
    assert got.dtype == torch.float32 and tuple(got.shape) == SHAPE
    torch.testing.assert_close(got, torch.from_numpy(reference(raw, type_name)), rtol=0, atol=0)


def test_f32_is_read_as_stored_and_owned():
    raw = encoded("F32", 2)
    raw.flags.writeable = False  # as a view of the file's map is
    got = dequantize(raw, "F32", SHAPE, "w")
    assert np.array_equal(got.numpy(), raw.view(np.float32).reshape(SHAPE))
    got += 1  # a copy of the (read-only) file bytes, not a view
    assert not np.array_equal(got.numpy(), raw.view(np.float32).reshape(SHAPE))


def test_a_buffer_read_for_it_is_taken_without_a_copy():
    """GGUFTensor.read's own buffer becomes the tensor: no second copy beside it at load."""
    raw = encoded("F32", 2).copy()
    got = dequantize(raw, "F32", SHAPE, "w")
    assert got.data_ptr() == raw.ctypes.data


def test_other_block_formats_go_through_gguf():
    raw = encoded("Q5_1", 3)
    got = dequantize(raw, "Q5_1", SHAPE, "w")
    assert np.array_equal(got.numpy(), reference(raw, "Q5_1"))


@pytest.mark.parametrize("type_name", ["F32", "F16", "Q8_0", "Q4_1", "Q5_1"])
def test_a_short_tensor_is_refused_by_name(type_name):
    raw = encoded(type_name, 4)[:-7]
    with pytest.raises(ValueError, match=rf"tensor 'blk\.0\.w' \({type_name}.*bytes, expected"):
        dequantize(raw, type_name, SHAPE, "blk.0.w")
