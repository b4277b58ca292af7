"""Applying a step's packed grammar bitmasks to its logits (the sampler's first step for the rows
with a grammar).

The bitmask is xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` allows token t;
the scheduler's side fills one row per constrained sequence (grammar.py's matchers), the worker
applies them here.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["apply_bitmask"]


def apply_bitmask(work: torch.Tensor, token_bitmask: torch.Tensor,
                  rows: list[tuple[int, int]], backend: str | None = None) -> None:
    """-inf, in place, on every token of `work` ([n, vocab] float32) that a packed bitmask
    forbids; `rows` pairs a row of `work` with its row of `token_bitmask` (int32 [m, words]).
    Bits past the vocabulary's end are ignored; tokens past the bitmask's end are forbidden.

    On the CPU (`backend` None or "numpy"): NumPy, in place, no torch thread pool involved: each
    byte of the packed mask picks its 8 additive biases (0 or -inf) from a 256-entry table.
    That measured 1.4-1.8x faster than xgrammar's CPU kernel (`apply_token_bitmask_inplace`,
    docs/figures/structured-outputs.md), so xgrammar's kernels serve the other devices only:
    Triton on CUDA (the bitmask, a few kB, is copied over instead of the logits being unpacked
    against on the host), plain torch elsewhere. `backend` names one of xgrammar's for tests."""
    vocab, words = work.shape[1], token_bitmask.shape[1]
    at = [j for j, _ in rows]
    picked = [r for _, r in rows]
    if backend is None:
        backend = "numpy" if work.device.type == "cpu" else _bitmask_backend(work.device)
    if backend == "numpy":
        packed = np.ascontiguousarray(token_bitmask.numpy().astype("<i4", copy=False))
        bits = 32 * words
        width = min(vocab, bits)
        # One row of biases at a time into a kept buffer: a fresh [rows, vocab] array per step
        # cost its page faults (2.5-4x the time at a 152k vocabulary).
        buf = _BIAS_ROWS.get(words)
        if buf is None:
            buf = _BIAS_ROWS[words] = np.empty((4 * words, 8), dtype=np.float32)
        flat = buf.reshape(-1)[:width]
        arr = work.numpy()
        for j, r in rows:
            np.take(_BYTE_BIAS, packed[r].view(np.uint8), axis=0, out=buf)
            np.add(arr[j, :width], flat, out=arr[j, :width])
            if bits < vocab:  # tokens past the bitmask's end are forbidden
                arr[j, bits:] = -np.inf
        return
    from xgrammar import apply_token_bitmask_inplace

    if at != picked:  # xgrammar pairs row i of the logits with row i of the bitmask
        aligned = token_bitmask.new_empty((max(at) + 1, words))
        aligned[at] = token_bitmask[picked]
        token_bitmask = aligned
    token_bitmask = token_bitmask.to(work.device, non_blocking=True)
    apply_token_bitmask_inplace(work, token_bitmask, vocab_size=min(vocab, 32 * words),
                                indices=at, backend=backend)
    if 32 * words < vocab:  # tokens past the bitmask's end are forbidden
        work[at, 32 * words:] = float("-inf")


# For each byte value, the additive bias of its 8 tokens (bit b set: token allowed, bias 0).
_BIAS_ROWS: dict[int, np.ndarray] = {}  # apply_bitmask's row buffer, per bitmask width
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                    bitorder="little") == 1, 0.0, -np.inf).astype(np.float32)


def _bitmask_backend(device: torch.device) -> str:
    """xgrammar's kernel for a device other than the CPU: Triton on CUDA when Triton is there,
    else plain torch (no compilation step)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch_native"
        return "triton"
    return "torch_native"
