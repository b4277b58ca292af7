"""GGUF block formats by name, the quantize-at-load choices, and which block format a
projection of a given width gets: the one table the loader's quantizer, the engine's weight
count and the planner all read (issue 31). Standard library only: `kvserve plan` and the
CLI's flags read it without the model's imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ggml's block layouts: (values per block, bytes per block). Q8_0: f16 d + 32 int8; Q4_0: f16
# d + 16 bytes of nibbles; Q4_1: f16 d, f16 m + 16; Q4_K: f16 d, f16 dmin, 12 bytes of packed
# 6-bit sub-block scales and mins, 128 of nibbles; Q5_K: Q4_K's with 32 bytes of fifth bits
# before the nibbles; Q6_K: 128 + 64 + 16 int8 scales + f16 d.
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144),
          "Q5_K": (256, 176), "Q6_K": (256, 210)}

# quantization= (vLLM's --quantization) values that quantize a float checkpoint's
# projections at load, and the block format each makes
AT_LOAD = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K"}
# every quantization= value: "gguf" keeps a GGUF file's own block formats, "none" runs float
QUANTIZATIONS = ("gguf", "none", *AT_LOAD)

# A projection whose input width is not a multiple of Q4_K's 256-value block (SmolLM2's 576,
# for one) takes Q4_1 instead, llama.cpp's practice of a 32-block fallback: Q4_1 keeps a min
# per block as Q4_K does per sub-block, at 20/32 bytes a value against 18/32 (144/256).
FALLBACK = {"Q4_K": "Q4_1"}


def projection_type(quantization: str, k: int) -> str | None:
    """The block format quantize-at-load gives a projection of input width `k`, or None where
    it stays float (k not a multiple of any block that applies)."""
    type_name = AT_LOAD[quantization]
    while type_name is not None:
        if k % BLOCKS[type_name][0] == 0:
            return type_name
        type_name = FALLBACK.get(type_name)
    return None


def block_bytes(type_name: str, n: int, k: int) -> int:
    """Bytes of an [n, k] tensor in `type_name`'s blocks (k a multiple of its block)."""
    values, nbytes = BLOCKS[type_name]
    if k % values:
        raise ValueError(f"{type_name} blocks hold {values} values; a row of {k} is not whole "
                         "blocks")
    return n * (k // values) * nbytes


def bytes_per_param(type_name: str) -> float:
    values, nbytes = BLOCKS[type_name]
    return nbytes / values


@dataclass(frozen=True)
class FileBlocks:
    """One weight as a file stores it, handed by the loader to the part that owns the weight
    (its projection's `file_blocks`, `kvserve.layers.projection`), whose quantized method
    makes its kernels' layout from it: `parts`, (type name, uint8 tensor [rows, bytes per row]) in row order, one per run
    of rows of one type (a fused qkv's q/k and v may differ); `k` the row's width in values."""

    parts: tuple[tuple[str, Any], ...]
    k: int

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.parts)
