"""GGUF tensors into float32 torch tensors, the common formats in torch itself.

Why not `gguf.quants` for everything: its numpy code runs on one core with a temporary per
step, and dequantizing SmolLM2's Q4_1/Q8_0 file took 1.8 s of every start (the whole start
target is 5 s). The formats llama.cpp's converters write most (F32, F16, BF16, Q8_0, Q4_0,
Q4_1) are a scale (and an offset) per 32-value block: a few whole-tensor torch operations,
spread over every core by torch's own threads. Every other block format (Q5_0, Q5_1, the
K-quants, the IQ types) goes through `gguf.quants`, the format's reference implementation;
tests/test_gguf_dequant.py checks the torch paths against it.

Block layouts (ggml-common.h): Q8_0 = f16 d, 32 x int8 q: d q. Q4_0 = f16 d, 16 bytes of
nibbles: value j is the low nibble of byte j, value 16 + j its high nibble: d (q - 8).
Q4_1 = f16 d, f16 m, the same nibbles: d q + m.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
# type -> bytes per 32-value block
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
TORCH_TYPES = frozenset({"F32", "F16", "BF16", *_BLOCK_BYTES})


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], name: str
               ) -> torch.Tensor:
    """The tensor stored as `raw` (its bytes, uint8) as float32 of `shape`; ValueError when the
    byte count does not fit the type and shape (a damaged file)."""
    n = int(np.prod(shape)) if shape else 1
    expected = _nbytes(type_name, n)
    if expected is not None and (raw.nbytes != expected
                                 or type_name in _BLOCK_BYTES and n % BLOCK):
        raise ValueError(f"tensor {name!r} ({type_name}, shape {list(shape)}) has {raw.nbytes} "
                         f"bytes, expected {expected}")
    if type_name not in TORCH_TYPES:
        return torch.from_numpy(_by_gguf(raw, type_name, shape, name))
    # a read-only array (a view of the file's map) is copied; a buffer of our own is not
    data = torch.from_numpy(raw if raw.flags.writeable else np.array(raw))
    if type_name == "F32":
        return data.view(torch.float32).view(shape)
    if type_name in ("F16", "BF16"):
        half = torch.float16 if type_name == "F16" else torch.bfloat16
        return data.view(half).view(shape).float()
    return _blocks(data.view(-1, _BLOCK_BYTES[type_name]), type_name).view(shape)


def _nbytes(type_name: str, n: int) -> int | None:
    if type_name == "F32":
        return 4 * n
    if type_name in ("F16", "BF16"):
        return 2 * n
    if type_name in _BLOCK_BYTES:
        return n // BLOCK * _BLOCK_BYTES[type_name]
    return None  # checked by _by_gguf


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block, as a float32 column [blocks, 1]."""
    return blocks[:, at: at + 2].contiguous().view(torch.float16).float()


def _blocks(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """[blocks, bytes] uint8 -> [blocks, 32] float32."""
    d = _scale(blocks, 0)
    if type_name == "Q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)
    quants = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]
    out = torch.empty(blocks.shape[0], 2, BLOCK // 2, dtype=torch.float32)
    out[:, 0] = quants & 0x0F
    out[:, 1] = quants >> 4
    out = out.view(-1, BLOCK)
    if type_name == "Q4_0":
        return out.sub_(8.0).mul_(d)
    return out.mul_(d).add_(_scale(blocks, 2))


def _by_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, ...], name: str
             ) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]  # check_types let it through
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) if shape else 1
    if n % block or raw.nbytes != n // block * block_bytes:
        raise ValueError(f"tensor {name!r} ({type_name}, shape {list(shape)}) has {raw.nbytes} "
                         f"bytes, expected {n // block * block_bytes}")
    rows = raw.reshape(-1, shape[-1] // block * block_bytes)
    return gguf.quants.dequantize(rows, qtype).reshape(shape)
