"""The timing harness of `kvserve bench kernels` (kernels.py, kernel_cases.py): paths
interleaved, the order alternating per round, so that a shared machine's drift hits every path
alike; and the check that a path's output matches its reference before it is timed, so that a
fast wrong kernel fails instead of winning."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class CheckError(AssertionError):
    """A path's output differs from the reference: its timings would mean nothing."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def check(name: str, got, want, atol: float, rtol: float = 1e-3) -> float:
    """The largest absolute difference of `got` from `want`; CheckError past the tolerance."""
    import torch

    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise CheckError(f"{name}: output shape {tuple(got.shape)}, the reference's "
                         f"{tuple(want.shape)}")
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        raise CheckError(f"{name}: output differs from the reference (max abs error {err:.3g})")
    return err


def _calls_for(fn: Callable[[], object], min_s: float) -> int:
    """Calls per sample so that a sample lasts about min_s (1 when a call already does)."""
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    return max(1, min(200, int(min_s / max(one, 1e-7))))


def interleaved(paths: dict[str, Callable[[], object]], repeats: int,
                before: Callable[[], object] | None = None,
                min_sample_s: float = 0.002) -> dict[str, dict[str, float]]:
    """Time each path `repeats` times, interleaved, the order reversed every other round; a
    sample is the mean of enough calls to last min_sample_s (one call after `before`, the
    cache evictor, when given). Returns min and median milliseconds per path."""
    calls = {n: 1 if before else _calls_for(f, min_sample_s) for n, f in paths.items()}
    samples: dict[str, list[float]] = {n: [] for n in paths}
    names = list(paths)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            if before is not None:
                before()
            fn, n = paths[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {n: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)}
            for n, v in samples.items()}
