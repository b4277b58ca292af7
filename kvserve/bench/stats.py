"""Percentiles and per-metric summaries, as `vllm bench` reports them (milliseconds, mean /
median / std and the requested percentiles, numpy's linear interpolation)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's
    default); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def parse_percentiles(text: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0]; each in [0, 100]."""
    out = [float(x) for x in text.split(",") if x.strip()]
    if any(not 0 <= q <= 100 for q in out):
        raise ValueError(f"percentiles must lie in [0, 100]: {text!r}")
    return out


def pct_label(q: float) -> str:
    """50 -> "p50", 99.9 -> "p99.9"."""
    return f"p{int(q) if float(q).is_integer() else q}"


def summarize(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std (population, as numpy's) and one pNN entry per percentile."""
    nan = float("nan")
    out = {"mean": statistics.fmean(values) if values else nan,
           "median": statistics.median(values) if values else nan,
           "std": statistics.pstdev(values) if values else nan}
    for q in percentiles:
        out[pct_label(q)] = percentile(values, q)
    return out


def spread(values: Sequence[float]) -> dict | None:
    """median, min, max and n of repeated runs (None for none): what a table of runs on a
    noisy machine shows, the median with the range it came from."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt_spread(s: dict | None, digits: int = 1) -> str:
    """"12.3 [11.9-12.8]", the median alone for one run, "-" for none."""
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
