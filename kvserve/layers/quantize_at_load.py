"""Quantize a float checkpoint's projections at load (issue 31: `quantization="q8_0" | "q4_0"
| "q4_1" | "q4_k"`, vLLM's --quantization) into ggml's block layouts, kept as the same
`QuantWeight`s a GGUF file's blocks become, so the same quantized methods run them
(`cpu_methods.QuantizedDecoder`, which calls `AtLoad.quantize` as it prepares each layer;
what a model then holds: kvserve/model_loader/weight_bytes.py).

What is quantized: every DecoderLayer's qkv, o, gate_up and down projections
(`PROJECTION_ATTRS`); the embedding, the norms, the biases and the LM head stay float32 (the
head: with tied embeddings it is the embedding table, so a quantized copy would add memory;
an untied head's accuracy under 4 bits is not measured in this slice). DeepSeek's MLA / MoE
layers have no quantized methods: asking for quantize-at-load there is a ValueError, not a
silent float model.

Q8_0, Q4_0 and Q4_1 are made by `gguf.quants.quantize` (ggml's own reference quantizers, in
numpy); Q4_K by `quantize_q4_k` here (numpy, vectorised over every block at once; checked
against `gguf.quants.dequantize`, the independent decoder, in tests/test_quantize_at_load.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from kvserve.utils import quant_formats
from kvserve.kernels.cpu import qgemv
from kvserve.layers.block import PROJECTION_ATTRS
from kvserve.layers.quant_linear import QuantWeight

logger = logging.getLogger("kvserve")

QK_K = 256  # values per Q4_K super-block: 8 sub-blocks of 32


# -- the quantizers -------------------------------------------------------------------------
def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> uint8 [n, k / 256 * 144] in ggml's block_q4_K:
    f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles;
    a value decodes as d * sc_j * q - dmin * m_j (q in 0..15, j its sub-block of 32).

    Per sub-block: min_j = min(0, min x), step_j = (max x - min_j) / 15; per super-block d =
    max step_j / 63, dmin = max(-min_j) / 63 (each rounded up to f16, so the 6-bit codes stay
    <= 63); sc_j = ceil(step_j / d) (the coded step covers the sub-block's range), m_j =
    round(-min_j / dmin). Then every value is within (d sc_j + dmin) / 2 of its decoding (the
    nibble's rounding, plus the min's), the bound the tests check."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"Q4_K rows are whole blocks of {QK_K}; got {k}")
    x = w.reshape(-1, 8, 32)  # [blocks, sub-block, value]
    lo = np.minimum(x.min(axis=2), 0.0)
    step = (x.max(axis=2) - lo) / 15.0
    d = _f16_up(step.max(axis=1) / 63.0)
    dmin = _f16_up((-lo).max(axis=1) / 63.0)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    safe_d = np.where(d32 > 0, d32, 1.0)[:, None]
    safe_dmin = np.where(dmin32 > 0, dmin32, 1.0)[:, None]
    sc = np.clip(np.ceil(step / safe_d - 1e-6), 0, 63).astype(np.uint8)
    # the coded step must not fall short of the range after the ceil's tolerance
    sc = np.where(sc.astype(np.float32) * d32[:, None] < step, np.minimum(sc + 1, 63), sc)
    m = np.clip(np.rint(-lo / safe_dmin), 0, 63).astype(np.uint8)
    scale = d32[:, None] * sc.astype(np.float32)  # [blocks, 8]
    offset = dmin32[:, None] * m.astype(np.float32)
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0)
    q = np.clip(np.rint((x + offset[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    # nibbles: per 64 values (two sub-blocks), byte l holds value l low, value 32 + l high
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = np.empty((q.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    head = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)  # [blocks, 4]
    blocks = np.concatenate([head, scales, qs], axis=1)
    return blocks.reshape(n, k // QK_K * 144)


def _f16_up(v: np.ndarray) -> np.ndarray:
    """v as float16, rounded up where nearest rounding went down."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def quantize(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """float [n, k] -> uint8 [n, row bytes] in ggml's `type_name` layout."""
    x = w.detach().to(torch.float32).contiguous().numpy()
    if type_name == "Q4_K":
        raw = quantize_q4_k(x)
    else:
        from gguf import GGMLQuantizationType, quants

        raw = quants.quantize(x, getattr(GGMLQuantizationType, type_name))
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).view(w.shape[0], -1)


# -- the model ------------------------------------------------------------------------------
def check_quantizable(config: Any, quantization: str) -> None:
    """ValueError where the engine cannot run `quantization`'s blocks on this model (a
    ModelConfig): checked before the model is built."""
    if quantization not in quant_formats.AT_LOAD:
        raise ValueError(f"quantize at load: one of {sorted(quant_formats.AT_LOAD)}, got "
                         f"{quantization!r}")
    if config.mla is not None or config.moe is not None:
        raise ValueError(f"quantization={quantization!r} quantizes DecoderLayer projections; "
                         f"{config.architecture}'s layers (MLA / MoE) have no quantized "
                         "methods: use quantization=None")
    if qgemv.load() is None:
        raise ValueError(f"quantization={quantization!r}: the quantized kernels cannot be "
                         "built here (no C++ compiler)")
    widths = (config.hidden_size, config.q_size, config.intermediate_size)
    wanted = {quant_formats.AT_LOAD[quantization]} | {
        quant_formats.projection_type(quantization, k) for k in widths} - {None}
    missing = sorted(t for t in wanted if t not in qgemv.TYPES)
    if missing:
        raise ValueError(f"quantization={quantization!r} needs the {', '.join(missing)} "
                         f"kernel, which this build of kvserve.kernels.cpu.qgemv lacks (it "
                         f"runs {', '.join(sorted(qgemv.TYPES))})")


class AtLoad:
    """Quantizes each DecoderLayer's projections as its method prepares it (`quantize`), its
    projections on one thread each (numpy releases the GIL), under one progress bar for the
    model; logs what it made after the last layer."""

    def __init__(self, quantization: str, num_layers: int, progress: bool = True) -> None:
        self.quantization, self.num_layers = quantization, num_layers
        self.progress = progress and num_layers > 1
        self._bar = None
        self._done = 0
        self._kept: dict[str, int] = {}
        self._t0 = 0.0

    def quantize(self, layer) -> dict[str, QuantWeight]:
        """`layer`'s projections (PROJECTION_ATTRS) as blocks, each float parameter dropped."""
        if self._done == 0:
            self._t0 = time.perf_counter()
            self._bar = tqdm(total=self.num_layers, desc=f"Quantizing to {self.quantization}",
                             unit="layer", disable=not self.progress, leave=False)
        jobs = {}
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            for attr in PROJECTION_ATTRS:
                p = getattr(layer, attr).weight
                type_name = quant_formats.projection_type(self.quantization, p.shape[1])
                if type_name is not None:
                    jobs[attr] = (type_name, p.shape[1], pool.submit(quantize, p, type_name))
            made = {}
            for attr, (type_name, k, job) in jobs.items():
                made[attr] = QuantWeight.for_kernels(job.result(), type_name, k)
                getattr(layer, attr).release()
                self._kept[type_name] = self._kept.get(type_name, 0) + 1
        self._done += 1
        self._bar.update(1)
        if self._done == self.num_layers:
            self._bar.close()
            logger.info("quantization %s: %s projections quantized at load in %.1f s",
                        self.quantization,
                        ", ".join(f"{n} {t}" for t, n in sorted(self._kept.items())),
                        time.perf_counter() - self._t0)
        return made
